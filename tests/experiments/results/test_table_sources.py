"""`fl-lightning table` of several plans: one table laid out as the paper's that they split (as
FedCONST's Table 1 is split by model and federation), its numbers beside; refused when two plans
would fill one cell or report different metrics."""

from pathlib import Path

import pytest
import yaml
from hand_written_runs import ROUNDS, write_plan_runs
from paths import QUICKSTART, REPOSITORY

from fl_lightning.commands.main import main as fl_lightning_main
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.results.table import table
from fl_lightning.experiments.results.table_sources import _block_value
from fl_lightning.run_logging import read_metrics

pytestmark = pytest.mark.slow  # end to end: the tests train runs in-process or in subprocesses
CONST = str(REPOSITORY / "configs" / "const.yaml")
TINY = {"federation.rounds": 1, "federation.local_steps": 1, "federation.eval_every": 1, "checkpoint.every": 1,
        "logger.wandb_mode": "disabled", "logger.progress_bar": False}
FEDERATIONS = {"cross-device": [{"federation.clients_per_round": 3}],
               "cross-silo": [{"federation.clients_per_round": 10}]}
METHODS = {"FedAvg": [{"algorithm": "fedavg"}], "FedAvg + CONST": [{"algorithm": "fedavg"}, CONST]}


def write_plan(folder: Path, hidden: int, federation: str, reference: dict = None, metric="test_accuracy") -> Path:
    name = f"table1_mlp{hidden}_{federation}"
    plan = {"name": name, "configs": [QUICKSTART, TINY, {"model.options": {"hidden": hidden, "depth": 1}}],
            "methods": METHODS, "settings": {"federation": {federation: FEDERATIONS[federation]}}, "seeds": [0],
            "metric": metric}
    if reference is not None:
        csv = folder / f"{name}.csv"
        csv.write_text(f"method,federation-{federation}\n" + "".join(f"{m},{v}\n" for m, v in reference.items()))
        plan["reference"] = str(csv)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def four_plans(tmp_path_factory):
    """A paper table split four ways, model x federation, as FedCONST's Table 1; every run trained."""
    folder = tmp_path_factory.mktemp("multi")
    runs = folder / "runs"
    plans = [write_plan(folder, 16, "cross-device", {"FedAvg": 46.12, "FedAvg + CONST": 54.28}),
             write_plan(folder, 16, "cross-silo", {"FedAvg": 53.12}),
             write_plan(folder, 32, "cross-device"),
             write_plan(folder, 32, "cross-silo", {"FedAvg + CONST": 72.44})]
    for path in plans:
        for point in load_plan(path, runs_root=runs).grid():
            fl_lightning_main(point.fit_arguments())
    return plans, runs


def accuracy(runs: Path, plan: Path, method: str) -> float:
    point = next(p for p in load_plan(plan, runs_root=runs).grid() if p.method == method)
    return 100 * read_metrics(point.out_dir)[-1]["test_accuracy"]


def test_four_plans_make_one_table_in_the_papers_order(four_plans, capsys):
    plans, runs = four_plans
    result = table(plan=[str(path) for path in plans], runs_root=runs)
    small, large = "hidden=16", "hidden=32"
    # Plans sharing a column are told apart by what differs between them (model.options.hidden): a block of
    # rows each; plans of other columns fill the same rows.
    assert result.methods == [f"{small}: FedAvg", f"{small}: FedAvg + CONST", f"{large}: FedAvg",
                              f"{large}: FedAvg + CONST"]
    assert result.settings == ["federation-cross-device", "federation-cross-silo"]
    for row, plan_of in {f"{small}: FedAvg": {0: plans[0], 1: plans[1]},
                         f"{large}: FedAvg + CONST": {0: plans[2], 1: plans[3]}}.items():
        for column, plan in plan_of.items():
            cell = result.cells[row, result.settings[column]]
            assert cell.values == [accuracy(runs, plan, row.partition(": ")[2])]
    # Each plan's reference gives the numbers of its own cells.
    papers = {key: cell.paper for key, cell in result.cells.items() if cell.paper is not None}
    assert papers == {(f"{small}: FedAvg", "federation-cross-device"): 46.12,
                      (f"{small}: FedAvg + CONST", "federation-cross-device"): 54.28,
                      (f"{small}: FedAvg", "federation-cross-silo"): 53.12,
                      (f"{large}: FedAvg + CONST", "federation-cross-silo"): 72.44}
    assert result.reference and not result.notes
    markdown = capsys.readouterr().out
    assert "| method | federation = cross-device | paper | Δ | federation = cross-silo | paper | Δ |" in markdown
    assert f"| {small}: FedAvg | " in markdown


def test_several_plans_on_the_command_line(four_plans, capsys):
    plans, runs = four_plans
    out = runs / "cli"
    for arguments in ([*map(str, plans)], [option for path in plans for option in ("--plan", str(path))]):
        capsys.readouterr()
        fl_lightning_main(["table", *arguments, "--runs_root", str(runs), "--out", str(out)])
        lines = capsys.readouterr().out.splitlines()
        assert sum(line.startswith("| hidden=") for line in lines) == 4
    # The default folder of the combined table is named after the plans.
    result = table(plan=[str(path) for path in plans], runs_root=runs)
    assert result.methods and any(p.name.startswith("table1_mlp+4plans-") for p in runs.iterdir())


def test_a_cell_two_plans_would_fill_is_refused(four_plans):
    plans, runs = four_plans
    with pytest.raises(ConfigError, match="plans that fill each cell of the table once"):
        table(plan=[str(plans[0]), str(plans[0])], runs_root=runs)


def test_plans_of_different_metrics_are_refused(four_plans, tmp_path):
    plans, runs = four_plans
    other = write_plan(tmp_path, 16, "cross-silo", metric="test_loss")
    with pytest.raises(ConfigError, match="plans that report one metric"):
        table(plan=[str(plans[0]), str(other)], runs_root=runs)


@pytest.mark.parametrize("seeds", [[1], [0, 1]])
def test_plans_that_differ_only_in_their_name_and_seeds_fill_the_same_cells_and_are_refused(four_plans, tmp_path,
                                                                                               seeds):
    # Once laid out with rows `seed=0: FedAvg` and `seed=1: FedAvg` (or `?: FedAvg`): the seed told them apart.
    plans, runs = four_plans
    copy = yaml.safe_load(plans[0].read_text())
    copy.update(name="table1_copy", seeds=seeds)
    other = tmp_path / "copy.yaml"
    other.write_text(yaml.safe_dump(copy, sort_keys=False))
    with pytest.raises(ConfigError, match="plans that fill each cell of the table once") as refused:
        table(plan=[str(plans[0]), str(other)], runs_root=runs)
    assert str(refused.value).endswith(f"got 'FedAvg | federation-cross-device in {plans[0]} and {other}'")


def test_the_baseline_of_a_table_of_several_plans_is_its_method_in_each_block_of_rows(four_plans):
    plans, runs = four_plans
    result = table(plan=[str(path) for path in plans], runs_root=runs, baseline="FedAvg")
    small, large = "hidden=16", "hidden=32"
    assert result.baseline_of == {f"{small}: FedAvg + CONST": f"{small}: FedAvg",
                                  f"{large}: FedAvg + CONST": f"{large}: FedAvg"}
    for block, plan in ((small, plans[0]), (large, plans[2])):
        versus = result.cells[f"{block}: FedAvg + CONST", "federation-cross-device"].versus
        assert versus.seeds == [0] and versus.differences == [
            accuracy(runs, plan, "FedAvg + CONST") - accuracy(runs, plan, "FedAvg")]
    with pytest.raises(ConfigError, match=r"baseline: expected a method of the table \(FedAvg, FedAvg \+ CONST\)"):
        table(plan=[str(path) for path in plans], runs_root=runs, baseline="SCAFFOLD")


def test_a_baseline_only_one_plan_has_says_which_rows_it_leaves_and_rows_are_labelled_by_what_tells_plans_apart(
        tmp_path):
    # Two plans of one column: FedAvg with and without CONST at hidden 16, SCAFFOLD alone at hidden 32. The
    # methods' own settings (the algorithm, CONST's model options) differ between them too, but tell no block.
    plans = []
    for hidden, methods in ((16, METHODS), (32, {"SCAFFOLD": [{"algorithm": "scaffold"}]})):
        path = tmp_path / f"mlp{hidden}.yaml"
        path.write_text(yaml.safe_dump({
            "name": f"mlp{hidden}", "configs": [QUICKSTART, {**TINY, "federation.rounds": ROUNDS},
                                                {"model.options": {"hidden": hidden, "depth": 1}}],
            "methods": methods, "settings": {"federation": {"cross-device": FEDERATIONS["cross-device"]}},
            "seeds": [0, 1, 2]}, sort_keys=False))
        write_plan_runs(path, tmp_path / "runs", [0.3, 0.5 + hidden / 1000])
        plans.append(str(path))
    result = table(plan=plans, runs_root=tmp_path / "runs", baseline="FedAvg", out=tmp_path / "out")
    assert result.methods == ["hidden=16: FedAvg", "hidden=16: FedAvg + CONST", "hidden=32: SCAFFOLD"]
    assert result.baseline_of == {"hidden=16: FedAvg + CONST": "hidden=16: FedAvg"}
    assert result.paired_text("hidden=32: SCAFFOLD", "federation-cross-device") == "–"
    assert "not compared with FedAvg: the rows of hidden=32, whose plan has no FedAvg" in result.notes
    assert all(row.split(": ")[1] in ("FedAvg", "FedAvg + CONST", "SCAFFOLD") for row in result.methods)


def test_a_block_named_by_a_dotted_path_shows_its_last_part():
    assert _block_value("model.name", "my_model.make_net") == "make_net"
    assert _block_value("model.name", "lenet5") == "lenet5"
    assert _block_value("model.options.hidden", 16) == "hidden=16"
