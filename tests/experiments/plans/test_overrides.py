"""`--override KEY=VALUE` of sweep, table and dashboard: applied last to every grid point; an override
that changes the experiment makes a variant of the plan whose runs live apart and are tabulated
apart, one that does not (data.root) keeps the plan's own runs."""

import csv
import dataclasses
import io
from pathlib import Path

import pytest
import yaml
from paths import QUICKSTART, REPOSITORY

from fl_lightning.commands.main import main as fl_lightning_main
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.overrides import parse_overrides, variant_name
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.plans.resolve import check_overrides, resolve_grid, settle_variant
from fl_lightning.experiments.results.dashboard import dashboard
from fl_lightning.experiments.results.table import table
from fl_lightning.run_logging import read_metrics

TINY = {"model.options": {"hidden": 16, "depth": 1}, "federation.rounds": 2, "federation.local_steps": 1,
        "federation.eval_every": 1, "checkpoint.every": 1, "logger.wandb_mode": "disabled",
        "logger.progress_bar": False}


def write_plan(path: Path) -> Path:
    plan = {"name": "tiny", "configs": [QUICKSTART, TINY], "methods": {"FedAvg": [{"algorithm": "fedavg"}]},
            "settings": {"alpha": {"0.5": [{"data.alpha": 0.5}]}}, "seeds": [0]}
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


@pytest.mark.parametrize("given, expected", [
    (["rounds"], "KEY=VALUE with a dotted fit setting"),
    (["federation rounds=2"], "KEY=VALUE with a dotted fit setting"),
    (["seed=3"], "a setting other than seed, out_dir"),
    (["logger.tags=[a]"], "a setting other than seed, out_dir"),
    (["fabric.devices=2"], "the sweep gives each run its devices: --gpus_per_run"),
    (["data.alpha=0.1", "data.alpha=0.2"], "each setting once"),
])
def test_bad_overrides_are_refused(given, expected):
    with pytest.raises(ConfigError, match=expected) as refused:
        parse_overrides(given)
    assert refused.value.field_name == "override"


def test_variant_names_are_readable_deterministic_and_distinct():
    rounds = parse_overrides(["federation.rounds=20"])
    assert variant_name("plan", rounds) == variant_name("plan", parse_overrides(["federation.rounds=20"]))
    assert variant_name("plan", rounds).startswith("plan@rounds20-")
    assert variant_name("plan", rounds) != variant_name("plan", parse_overrides(["federation.rounds=30"]))
    # Two keys of one last name stay apart (the digest), and the order given does not matter.
    both = ["federation.rounds=20", "data.alpha=0.1"]
    assert variant_name("plan", parse_overrides(both)) == variant_name("plan", parse_overrides(both[::-1]))
    assert variant_name("plan", parse_overrides(["a.rounds=20"])) != variant_name("plan", rounds)
    # A value that is no short folder name gives the digest alone, and so does a hint too long for a W&B tag.
    assert len(variant_name("plan", parse_overrides(["model.options={hidden: 8, depth: 2}"]))) == len("plan@") + 8
    long_name = "fedconst_table1_resnet18_cross-device"
    assert variant_name(long_name, parse_overrides(["federation.local_steps=10"])) == f"{long_name}@" + variant_name(
        "plan", parse_overrides(["federation.local_steps=10"]))[-8:]
    # Settings a resume may change keep the plan's name, but for the rounds (another table).
    assert variant_name("plan", parse_overrides(["data.root=/scratch/data", "logger.wandb_mode=online"])) == "plan"
    assert variant_name("plan", parse_overrides(["data.root=/scratch", *both])) == variant_name(
        "plan", parse_overrides(both))


def test_overrides_come_last_in_every_point(tmp_path):
    plan = load_plan(write_plan(tmp_path / "plan.yaml"), runs_root=tmp_path / "runs",
                     overrides=["federation.rounds=1", "data.alpha=0.1"])
    point = plan.grid()[0]
    arguments = point.fit_arguments()
    seed = arguments.index("--seed")
    assert arguments[seed + 2:seed + 6] == ["--federation.rounds", "1", "--data.alpha", "0.1"]
    assert point.out_dir == tmp_path / "runs" / plan.name / "alpha-0.5" / "fedavg" / "seed0"
    assert f"plan={plan.name}" in arguments[-1] and plan.name != "tiny"


@pytest.mark.slow
def test_a_variant_lives_apart_and_never_mixes_with_the_plan_in_a_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    path = write_plan(tmp_path / "plan.yaml")
    runs = tmp_path / "runs"
    base = load_plan(path, runs_root=runs)
    variant = load_plan(path, runs_root=runs, overrides=["federation.rounds=1"])
    for plan in (base, variant):
        for point in plan.grid():
            fl_lightning_main(point.fit_arguments())
    base_dir, variant_dir = base.grid()[0].out_dir, variant.grid()[0].out_dir
    assert base_dir != variant_dir and variant_dir.parts[-4] == variant.name
    assert [row["round"] for row in read_metrics(base_dir)] == [1, 2]
    assert [row["round"] for row in read_metrics(variant_dir)] == [1]

    base_table = table(plan=str(path), runs_root=runs)
    variant_table = table(plan=str(path), runs_root=runs, override=["federation.rounds=1"])
    (base_cell,), (variant_cell,) = base_table.cells.values(), variant_table.cells.values()
    assert base_cell.values == [100 * read_metrics(base_dir)[-1]["test_accuracy"]]
    assert variant_cell.values == [100 * read_metrics(variant_dir)[-1]["test_accuracy"]]
    assert not base_table.notes and not variant_table.notes
    assert (runs / "tiny" / "table.md").is_file() and (runs / variant.name / "table.md").is_file()
    # The variant's table says its scale: in the caption, in table.csv, and in variant.yaml beside it.
    markdown = (runs / variant.name / "table.md").read_text()
    assert (f"Plan variant {variant.name}: the runs have federation.rounds=1 (--override), not the plan's own "
            "settings.") in markdown.splitlines()
    assert "Plan variant" not in (runs / "tiny" / "table.md").read_text()
    (row,) = csv.DictReader(io.StringIO((runs / variant.name / "table.csv").read_text()))
    assert (row["plan"], row["overrides"]) == (variant.name, "federation.rounds=1")
    recorded = yaml.safe_load((runs / variant.name / "variant.yaml").read_text())
    assert recorded == {"variant": variant.name, "plan_files": [str(path)], "overrides": {"federation.rounds": 1},
                        "sweep": [f"fl-lightning sweep {path} --override=federation.rounds=1"]}
    assert not (runs / "tiny" / "variant.yaml").exists()

    # On the command line, repeated; data.root does not change the experiment: the same variant.
    capsys.readouterr()
    fl_lightning_main(["sweep", str(path), "--runs_root", str(runs), "--override", "federation.rounds=1",
                       "--override", "data.root=elsewhere", "--list"])
    out = capsys.readouterr().out
    assert (f"plan variant {variant.name} of tiny (federation.rounds=1, data.root=elsewhere): its runs in "
            f"{runs / variant.name}") in out
    assert f"finished  {variant_dir}" in out
    assert out.splitlines()[-1] == "1 runs: 1 finished, 0 partial, 0 without a checkpoint"
    fl_lightning_main(["sweep", str(path), "--runs_root", str(runs), "--override", "data.root=elsewhere", "--list"])
    out = capsys.readouterr().out
    assert "overrides data.root=elsewhere: the plan's own runs (no override changes the experiment)" in out
    assert f"finished  {base_dir}" in out
    # A sweep of the variant (here finding its run finished) writes variant.yaml into its folder too.
    (runs / variant.name / "variant.yaml").unlink()
    fl_lightning_main(["sweep", str(path), "--runs_root", str(runs), "--override", "federation.rounds=1"])
    assert yaml.safe_load((runs / variant.name / "variant.yaml").read_text())["overrides"] == {"federation.rounds": 1}


@pytest.mark.slow
def test_an_override_that_restates_what_every_point_has_is_the_plans_own_runs(tmp_path, capsys, monkeypatch):
    # A user's 2-round override of a 2-round plan, data.validation=0 (the same run as none), the alpha of
    # its one column: no variant, so the finished run is found, swept as finished and tabulated.
    monkeypatch.setenv("WANDB_MODE", "disabled")
    path = write_plan(tmp_path / "plan.yaml")
    runs = tmp_path / "runs"
    (point,) = load_plan(path, runs_root=runs).grid()
    fl_lightning_main(point.fit_arguments())
    accuracy = 100 * read_metrics(point.out_dir)[-1]["test_accuracy"]
    restating = [["federation.rounds=2"], ["data.validation=0"], ["data.alpha=0.5"],
                 ["federation.rounds=2", "data.validation=0", "data.root=elsewhere"]]
    for overrides in restating:
        result = table(plan=str(path), runs_root=runs, override=overrides)
        assert (result.plan, result.overrides, result.notes) == ("tiny", {}, [])
        assert [cell.values for cell in result.cells.values()] == [[accuracy]]
        assert dashboard(path, offline=True, runs_root=runs, override=overrides)["plan"] == "tiny"
    capsys.readouterr()
    fl_lightning_main(["sweep", str(path), "--runs_root", str(runs), "--override", "federation.rounds=2",
                       "--override", "data.root=elsewhere"])
    out = capsys.readouterr().out
    assert out.startswith("overrides federation.rounds=2, data.root=elsewhere: the plan's own runs (federation."
                          "rounds=2: what every point has already; the others do not change the experiment)")
    assert "[0] skipped, finished" in out and sorted(path.name for path in runs.iterdir()) == ["tiny"]
    # With an override that changes a point, the variant is named for that one alone.
    fl_lightning_main(["sweep", str(path), "--runs_root", str(runs), "--override", "federation.rounds=2",
                       "--override", "federation.local_steps=2", "--list"])
    variant = load_plan(path, overrides=["federation.local_steps=2"]).name
    assert variant.startswith("tiny@local_steps2-") and f"plan variant {variant} of tiny " in capsys.readouterr().out


def test_a_plan_is_a_value_named_for_its_variant_by_settle_variant(tmp_path):
    path = write_plan(tmp_path / "plan.yaml")
    given = load_plan(path, overrides=["federation.rounds=2", "federation.local_steps=2"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.name = "another"
    settled = settle_variant(given)
    # Named for the override that changes a point alone; the plan given is left as it was.
    assert settled.name == load_plan(path, overrides=["federation.local_steps=2"]).name != given.name
    assert settled.restated == {"federation.rounds"} and given.restated == frozenset()
    assert {point.out_dir.parent.parent.parent.name for point in settled.grid()} == {settled.name}
    unchanged = load_plan(path)
    assert settle_variant(unchanged) is unchanged  # no overrides: nothing to settle


def test_the_dashboard_of_a_variant_shows_the_variants_runs(tmp_path, capsys):
    path = write_plan(tmp_path / "plan.yaml")
    spec = dashboard(path, offline=True, runs_root=tmp_path / "runs", override=["federation.rounds=1"])
    variant = load_plan(path, overrides=["federation.rounds=1"]).name
    assert spec["plan"] == variant and spec["sections"][0]["filters"]["tags"] == [f"plan={variant}"]
    assert (tmp_path / "runs" / variant / "dashboard.json").is_file()
    assert "--override=federation.rounds=1" in capsys.readouterr().out


CTPFL = str(REPOSITORY / "configs" / "algorithms" / "ctpfl.yaml")


def write_grid_plan(path: Path, methods: dict, alpha: dict) -> Path:
    plan = {"name": "grid", "configs": [QUICKSTART, TINY], "methods": methods, "settings": {"alpha": alpha},
            "seeds": [0, 1]}
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def refusals(capsys, tmp_path: Path, plan: Path, override: str) -> list[str]:
    """What sweep, table and dashboard print to stderr for the plan with `override`: each must exit 2."""
    runs = str(tmp_path / "runs")
    printed = []
    for command in (["sweep", str(plan), "--list"], ["table", str(plan)], ["dashboard", str(plan), "--offline"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            fl_lightning_main([*command, "--runs_root", runs, "--override", override])
        assert exit_info.value.code == 2, command
        printed.append(capsys.readouterr().err)
    return printed


def test_an_override_of_what_an_axis_or_a_method_sets_is_refused_alike_by_sweep_table_and_dashboard(tmp_path,
                                                                                                     capsys):
    # Both columns would train alpha 0.3 (one seed each, the same runs) under the labels 0.5 and 0.1; both
    # CTP-FL rows span 0.3.
    plan = write_grid_plan(tmp_path / "plan.yaml",
                           {"CTP-FL": [CTPFL], "CTP-FL h=0": [CTPFL, {"algorithm.init_args.span": 0.0}]},
                           {"0.5": [{"data.alpha": 0.5}], "0.1": [{"data.alpha": 0.1}]})
    expected = ("error: override: expected settings that no setting axis or method of the plan sets ({}: each column "
                "or row would train the override's value under its own label; change the plan, or a copy of it, "
                "instead), got '{}'\n")
    for override, reason in [("data.alpha=0.3", "data.alpha is set by settings.alpha"),
                             ("algorithm.init_args.span=0.3", "algorithm.init_args.span is set by method CTP-FL h=0"),
                             ("algorithm.span=0.3", "algorithm.span is set by method CTP-FL h=0"),
                             ("data={alpha: 0.3}", "data is set by settings.alpha")]:
        assert refusals(capsys, tmp_path, plan, override) == [expected.format(reason, override)] * 3
    # A setting of the plan's configs alone is every point's to override.
    fl_lightning_main(["sweep", str(plan), "--runs_root", str(tmp_path / "runs"), "--list",
                       "--override", "federation.rounds=1"])
    assert capsys.readouterr().out.splitlines()[-1] == "8 runs: 0 finished, 0 partial, 8 without a checkpoint"


def test_what_config_fragments_of_an_axis_or_a_method_set_is_found_in_the_points_settings(tmp_path):
    fragments = {"alpha05.yaml": "data: {alpha: 0.5}\n", "alpha01.yaml": "data: {alpha: 0.1}\n",
                 "h0.yaml": "algorithm: {init_args: {span: 0.0}}\n"}
    for name, text in fragments.items():
        (tmp_path / name).write_text(text)
    plan_file = write_grid_plan(tmp_path / "plan.yaml", {"FedAvg": [{"algorithm": "fedavg"}], "CTP-FL": [CTPFL],
                                                         "CTP-FL h=0": [CTPFL, str(tmp_path / "h0.yaml")]},
                                {"0.5": [str(tmp_path / "alpha05.yaml")], "0.1": [str(tmp_path / "alpha01.yaml")]})

    def refused(override: str) -> str:
        plan = load_plan(plan_file, overrides=[override])
        with pytest.raises(ConfigError) as refusal:
            check_overrides(plan, resolve_grid(plan.grid()))
        assert refusal.value.field_name == "override"
        return str(refusal.value)

    assert "(data.alpha is set by settings.alpha: " in refused("data.alpha=0.3")
    # The methods whose settings hold a span: FedAvg has none.
    assert "(algorithm.init_args.span is set by methods CTP-FL, CTP-FL h=0: " in refused("algorithm.init_args.span=1")
    plan = load_plan(plan_file, overrides=["model.options.hidden=8"])
    check_overrides(plan, resolve_grid(plan.grid()))  # the plan's configs set it, for every point alike
    # An axis of one value: its column would be labelled alpha 0.5 over runs of alpha 0.1.
    single = load_plan(write_plan(tmp_path / "single.yaml"), overrides=["data.alpha=0.1"])
    with pytest.raises(ConfigError, match=r"\(data.alpha is set by settings.alpha: "):
        check_overrides(single, resolve_grid(single.grid()))


def test_an_override_fit_refuses_is_refused_by_table_as_by_sweep_and_dashboard(tmp_path, capsys):
    # FedProx's points are refused by fit without any override: while they have no runs, a table leaves
    # them out; only the points the override breaks are named.
    plan = write_grid_plan(tmp_path / "plan.yaml", {"FedAvg": [{"algorithm": "fedavg"}],
                                                    "FedProx": [{"algorithm": "fedprox"},
                                                                {"algorithm.init_args.mu": "much"}]},
                           {"0.5": [{"data.alpha": 0.5}]})
    unknown = ("federation.roundz: expected a known setting (did you mean federation.rounds?), "
               "got the unknown key '--federation.roundz'")
    table_error, *others = refusals(capsys, tmp_path, plan, "federation.roundz=2")
    assert table_error.splitlines() == [
        "error: override: expected settings that fit accepts at every grid point (2 of 4 points are refused with "
        f"the overrides and accepted without them), got {plan}, where",
        f"  [0] FedAvg | alpha-0.5 | seed 0: {unknown}", f"  [1] FedAvg | alpha-0.5 | seed 1: {unknown}"]
    assert others == [table_error] * 2
    table(plan=str(plan), runs_root=tmp_path / "runs", override=["federation.rounds=1"])  # accepted
