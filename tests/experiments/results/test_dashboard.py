"""`fl-lightning dashboard`: the W&B report of a plan, checked as its spec and as the wandb-workspaces
objects built from it, without a W&B server (saving is replaced where a test needs it)."""

import json
import re
from pathlib import Path

import pytest
import wandb_workspaces.reports.v2 as wr
import yaml
from paths import REPOSITORY
from wandb_workspaces import expr

from fl_lightning.commands.main import main
from fl_lightning.diagnostics.local_updates import ClientDrift
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.results import dashboard as dashboard_module
from fl_lightning.experiments.results.dashboard import (
    DIAGNOSTIC_METRICS,
    build_report,
    dashboard,
    dashboard_spec,
    diagnostic_metrics,
    filter_expression,
)
from fl_lightning.metric_names import COST_COUNTERS

# End to end: the tests train runs in-process or in subprocesses.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("in_repository_root")]
SMOKE = "configs/plans/smoke.yaml"
COST_PANELS = [f"test_accuracy by {counter}" for counter in COST_COUNTERS]
"""The panels of test accuracy against each cost counter, last in every section."""


@pytest.fixture
def no_api_key(monkeypatch, tmp_path):
    """No W&B credentials anywhere W&B looks: neither the environment, nor its settings, nor ~/.netrc."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


@pytest.fixture
def saved_reports(monkeypatch) -> list:
    """Report.save records the report instead of sending it; its URL is made up."""
    saved = []
    monkeypatch.setattr(wr.Report, "save", lambda report, *args, **kwargs: saved.append(report) or report)
    monkeypatch.setattr(wr.Report, "url", property(lambda report: f"https://wandb.test/{report.entity}/report"))
    return saved


def filter_values(expression: str) -> dict:
    """What a filter expression selects, as W&B receives it: the tags required and config key -> value."""
    v2 = expr.filters_tree_to_v2(expr.expr_to_filters(expression))
    selected = {"tags": [], "config": {}}
    for item in v2["filters"]:
        if item["key"] == {"section": "run", "name": "tags"}:
            assert item["op"] == "IN"
            selected["tags"] += item["value"]
        else:
            assert item["key"]["section"] == "config" and item["op"] == "="
            selected["config"][item["key"]["name"]] = item["value"]
        assert item.get("connector", "AND") == "AND"
    return selected


def write_plan(tmp_path: Path, **changes) -> Path:
    plan = yaml.safe_load((REPOSITORY / SMOKE).read_text())
    plan.update(changes)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def test_the_smoke_plans_spec_has_a_section_per_setting_filtered_by_its_tag_and_grouped_by_method(tmp_path, capsys):
    out = tmp_path / "spec.json"
    main(["dashboard", SMOKE, "--offline", "--out", str(out)])
    printed = capsys.readouterr().out
    spec = json.loads(out.read_text())
    settings = list(dict.fromkeys(point.setting_name for point in load_plan(REPOSITORY / SMOKE).grid()))
    assert settings == ["alpha-0.5", "alpha-0.1"]
    assert [section["name"] for section in spec["sections"]] == settings
    assert [section["label"] for section in spec["sections"]] == ["α = 0.5", "α = 0.1"]
    assert spec["project"] == "fl-lightning" and spec["entity"] is None and spec["plan"] == "smoke"
    assert spec["best"] == {"summary": "best_test_accuracy", "selected_on": ["val_accuracy"]}
    for section in spec["sections"]:
        assert section["filters"] == {"tags": ["plan=smoke"], "config": {"setting": section["name"]}}
        assert section["groupby"] == ["config.method"]
        assert section["columns"] == ["summary:final_test_accuracy", "summary:best_test_accuracy",
                                      "summary:best_test_accuracy_round", "summary:best_test_accuracy_selected_on"]
        panels = {panel["title"]: panel for panel in section["panels"]}
        # The smoke plan turns on no diagnostic: accuracy, loss and the summary's results only; with its
        # validation split its best test accuracy is at the best val_accuracy, and the bars say so.
        assert list(panels) == ["test_accuracy", "val_accuracy", "train_loss", "final_test_accuracy",
                                "best_test_accuracy (at the best val_accuracy)", *COST_PANELS]
        for panel in section["panels"]:
            assert (panel["groupby"], panel["aggregate"], panel["band"]) == ("config.method", "mean", "minmax")
        for metric in ("test_accuracy", "val_accuracy"):
            assert panels[metric]["type"] == "line" and panels[metric]["y"] == [metric]
            assert panels[metric]["x"] == "Step"  # the W&B step is the round
        for counter, title in zip(COST_COUNTERS, COST_PANELS):  # a cost counter the x-axis, in place of the step
            assert panels[title] == {**panels[title], "type": "line", "x": counter, "y": ["test_accuracy"]}
        assert panels["final_test_accuracy"] == {**panels["final_test_accuracy"], "type": "bar",
                                                 "metrics": ["final_test_accuracy"]}
    assert f"spec: {out}" in printed
    assert "not created in W&B (--offline)" in printed
    assert "\n  fl-lightning dashboard configs/plans/smoke.yaml\n" in printed
    # The smoke plan's runs leave W&B off: the report would stay empty.
    assert ("note: W&B lacks 12 of the plan's 12 runs (12 not run yet, with logger.wandb_mode disabled); "
            "`fl-lightning publish configs/plans/smoke.yaml` sends the logs") in printed


def test_the_report_built_from_the_spec_filters_groups_and_bands_each_section(tmp_path):
    spec = dashboard(Path(SMOKE), entity="my-team", band="std", offline=True, out=tmp_path / "spec.json")
    report = build_report(spec)
    assert (report.entity, report.project, report.title) == ("my-team", "fl-lightning", "smoke: methods compared")
    grids = [block for block in report.blocks if isinstance(block, wr.PanelGrid)]
    headings = [block.text for block in report.blocks if isinstance(block, wr.H2)]
    assert headings == ["α = 0.5 (alpha-0.5)", "α = 0.1 (alpha-0.1)"]
    for grid, setting in zip(grids, ["alpha-0.5", "alpha-0.1"], strict=True):
        (runset,) = grid.runsets
        assert (runset.entity, runset.project) == ("my-team", "fl-lightning")
        assert filter_values(runset.filters) == {"tags": ["plan=smoke"], "config": {"setting": setting}}
        assert runset.groupby == ["config.method"]
        assert runset.pinned_columns == ["summary:final_test_accuracy", "summary:best_test_accuracy",
                                         "summary:best_test_accuracy_round", "summary:best_test_accuracy_selected_on"]
        lines = [panel for panel in grid.panels if isinstance(panel, wr.LinePlot)]
        bars = [panel for panel in grid.panels if isinstance(panel, wr.BarPlot)]
        assert [line.y for line in lines] == [["test_accuracy"], ["val_accuracy"], ["train_loss"],
                                              *[["test_accuracy"]] * len(COST_COUNTERS)]
        assert [line.x for line in lines] == ["Step"] * 3 + list(COST_COUNTERS)
        assert [bar.metrics for bar in bars] == [["final_test_accuracy"], ["best_test_accuracy"]]
        for panel in lines + bars:
            assert panel.groupby == wr.Config("method")
            assert (panel.groupby_aggfunc, panel.groupby_rangefunc) == ("mean", "stddev")


def test_a_plan_with_a_validation_split_and_per_client_evaluation_gets_their_panels(tmp_path):
    split = {"data.validation": 0.2, "data.per_client_eval": True}
    plan = yaml.safe_load((REPOSITORY / SMOKE).read_text())
    spec = dashboard(write_plan(tmp_path, configs=[*plan["configs"], split]), offline=True, out=tmp_path / "spec.json")
    assert spec["best"] == {"summary": "best_test_accuracy", "selected_on": ["val_accuracy"]}
    titles = [panel["title"] for panel in spec["sections"][0]["panels"]]
    assert titles == ["test_accuracy", "val_accuracy", "train_loss", "client_val_accuracy_mean",
                      "client_val_accuracy_p10", "client_val_accuracy_min", "final_test_accuracy",
                      "best_test_accuracy (at the best val_accuracy)", *COST_PANELS]
    lines = [panel for panel in build_report({**spec, "entity": "my-team"}).blocks[2].panels
             if isinstance(panel, wr.LinePlot)]
    assert [line.y for line in lines][3:6] == [["client_val_accuracy_mean"], ["client_val_accuracy_p10"],
                                               ["client_val_accuracy_min"]]
    # One method with the split, one without: the bars say both ways their runs' best was selected.
    methods = {"FedAvg": [*plan["methods"]["FedAvg"], split], "FedAvg + CONST": plan["methods"]["FedAvg + CONST"]}
    without_split = [part for part in plan["configs"] if part != {"data.validation": 0.2}]
    spec = dashboard(write_plan(tmp_path, configs=without_split, methods=methods, tune=None), offline=True,
                     out=tmp_path / "spec.json")
    assert spec["best"]["selected_on"] == ["val_accuracy", "test_accuracy"]
    best_panel = spec["sections"][0]["panels"][-1 - len(COST_PANELS)]
    assert best_panel["title"] == ("best_test_accuracy (at the best val_accuracy or selected on the test set: no "
                                   "validation split)")


def test_tags_and_values_holding_operators_reach_wandb_as_written():
    # wandb-workspaces reads `=` inside a string as an operator: `plan=smoke` written plainly becomes `plan==smoke`.
    filters = {"tags": ["plan=a<b>c"], "config": {"setting": "alpha=0.5"}}
    assert filter_values(filter_expression(filters)) == filters


def test_the_diagnostics_a_plan_turns_on_get_their_panel_groups(tmp_path):
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text(yaml.safe_dump({"callbacks": [
        {"class_path": "fl_lightning.diagnostics.landscape.Landscape", "init_args": {"every": 3}},
        {"class_path": "fl_lightning.callbacks.EarlyStopping", "init_args": {"metric": "test_accuracy"}},
    ]}))
    plan = load_plan(REPOSITORY / SMOKE)
    methods = {"FedAvg": [*plan.methods["FedAvg"], str(callbacks)],
               "FedAvg + CONST": [*plan.methods["FedAvg + CONST"],
                                  {"callbacks": [{"class_path": "fl_lightning.diagnostics.local_updates.ClientDrift"},
                                                 {"class_path": "fl_lightning.diagnostics.gsnr.GradientVariance"}]}]}
    spec = dashboard(write_plan(tmp_path, methods=methods), offline=True, out=tmp_path / "spec.json")
    panels = spec["sections"][0]["panels"][5:-len(COST_PANELS)]
    assert [panel["title"] for panel in panels] == ["hessian/*", "client_drift/*", "gradient_variance",
                                                    "gradient_variance/*"]
    for panel in panels:
        assert (panel["groupby"], panel["x"]) == ("config.method", "Step")
    assert re.match(panels[0]["metric_regex"], "hessian/lambda_max")
    assert not re.match(panels[3]["metric_regex"], "gradient_variance")  # its own panel, panels[2]
    assert panels[2]["y"] == ["gradient_variance"]


def test_what_the_diagnostics_log_falls_in_their_panel_groups():
    """Every metric name the diagnostics' own tests see them log is drawn by a panel of its diagnostic."""
    from diagnostic_problems import by_hand

    from fl_lightning.diagnostics.landscape import METRICS

    def drawn(name: str, metrics: list[str]) -> bool:
        return name in metrics or any(metric.endswith("/") and name.startswith(metric) for metric in metrics)

    local = [path for path in DIAGNOSTIC_METRICS if ".local_updates." in path or ".gsnr." in path]
    assert all(drawn(name, diagnostic_metrics(local)) for name in by_hand())
    landscape = diagnostic_metrics(["fl_lightning.diagnostics.landscape.Landscape"])
    assert all(drawn(name, landscape) for name in METRICS)
    assert not drawn("test_accuracy", diagnostic_metrics(list(DIAGNOSTIC_METRICS)))


class DriftVariant(ClientDrift):
    """A user's diagnostic of its own, logging what ClientDrift does."""


def test_every_diagnostic_is_known_by_its_class_and_its_subclasses():
    assert diagnostic_metrics([f"{__name__}.DriftVariant"]) == ["client_drift/"]
    assert set(diagnostic_metrics(list(DIAGNOSTIC_METRICS))) == {m for ms in DIAGNOSTIC_METRICS.values() for m in ms}
    assert diagnostic_metrics(["fl_lightning.callbacks.EarlyStopping"]) == []


def test_without_an_api_key_only_the_spec_is_written(tmp_path, capsys, no_api_key, saved_reports):
    dashboard(Path(SMOKE), entity="my-team", band="std", out=tmp_path / "spec.json")
    printed = capsys.readouterr().out
    assert saved_reports == []
    assert "not created in W&B (no W&B API key" in printed
    assert "\n  fl-lightning dashboard configs/plans/smoke.yaml --entity my-team --band std\n" in printed
    assert (tmp_path / "spec.json").is_file()


def test_wandb_mode_offline_writes_the_spec_only(tmp_path, capsys, monkeypatch, saved_reports):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    dashboard(Path(SMOKE), out=tmp_path / "spec.json")
    assert saved_reports == []
    assert "not created in W&B (WANDB_MODE=offline)" in capsys.readouterr().out


def test_an_empty_wandb_mode_is_taken_as_unset(tmp_path, capsys, no_api_key, monkeypatch, saved_reports,
                                               wandb_reads_the_environment_afresh):
    """`WANDB_MODE= fl-lightning dashboard PLAN`: W&B itself dies on the empty value (a pydantic
    ValidationError) after the spec is written."""
    monkeypatch.setenv("WANDB_MODE", "")
    dashboard(Path(SMOKE), out=tmp_path / "spec.json")
    assert saved_reports == []
    assert "not created in W&B (no W&B API key" in capsys.readouterr().out


def test_an_unknown_wandb_mode_is_refused_before_the_spec_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(SystemExit) as exited:
        main(["dashboard", SMOKE, "--out", str(tmp_path / "spec.json")])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: WANDB_MODE: expected one of online, offline, disabled, dryrun, shared, run, or unset, got 'ofline'"]
    assert not (tmp_path / "spec.json").exists()


def test_with_an_api_key_the_report_is_saved_and_its_address_printed(tmp_path, capsys, no_api_key, monkeypatch,
                                                                       saved_reports):
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    spec = dashboard(Path(SMOKE), entity="my-team", out=tmp_path / "spec.json")
    assert json.loads((tmp_path / "spec.json").read_text()) == spec
    (report,) = saved_reports
    assert report.entity == "my-team" and len([b for b in report.blocks if isinstance(b, wr.PanelGrid)]) == 2
    assert "W&B report: https://wandb.test/my-team/report" in capsys.readouterr().out


def test_a_report_wandb_does_not_take_leaves_the_spec_and_the_command_and_exits_1(tmp_path, capsys, no_api_key,
                                                                                   monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)

    def unreachable(report, *args, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(wr.Report, "save", unreachable)
    with pytest.raises(SystemExit) as exited:
        dashboard(Path(SMOKE), entity="my-team", out=tmp_path / "spec.json")
    assert exited.value.code == 1
    error = capsys.readouterr().err
    assert "the W&B report was not created (ConnectionError: no route to host)" in error
    assert f"the spec is in {tmp_path / 'spec.json'}" in error
    assert "fl-lightning dashboard configs/plans/smoke.yaml --entity my-team" in error
    assert (tmp_path / "spec.json").is_file()


def test_runs_logging_to_several_projects_need_the_project_named(tmp_path, capsys):
    plan = load_plan(REPOSITORY / SMOKE)
    methods = {"FedAvg": plan.methods["FedAvg"],
               "FedAvg + CONST": [*plan.methods["FedAvg + CONST"], {"logger.project": "elsewhere"}]}
    path = write_plan(tmp_path, methods=methods)
    with pytest.raises(ConfigError, match=r"^project: expected one W&B project .*\['elsewhere', 'fl-lightning'\]"):
        dashboard(path, offline=True, out=tmp_path / "spec.json")
    spec = dashboard(path, project="elsewhere", offline=True, out=tmp_path / "spec.json")
    assert spec["project"] == "elsewhere"
    assert f"fl-lightning dashboard {path} --project elsewhere" in capsys.readouterr().out


def test_the_spec_goes_into_the_plans_run_folder_by_default(tmp_path, capsys):
    dashboard(Path(SMOKE), offline=True, runs_root=tmp_path)
    assert (tmp_path / "smoke" / dashboard_module.SPEC_FILE).is_file()


def test_a_title_longer_than_wandb_takes_is_refused():
    plan = load_plan(REPOSITORY / SMOKE)
    runs = {"diagnostics": [], "selected_on": {"test_accuracy"}, "per_client_eval": False}
    with pytest.raises(ConfigError, match=r"^title: expected at most 128 characters"):
        dashboard_spec(plan, project="fl-lightning", entity=None, title="x" * 129, band="minmax", **runs)
    assert dashboard_spec(plan, project="fl-lightning", entity=None, title="x" * 128, band="minmax",
                          **runs)["title"] == "x" * 128


def test_the_note_tells_what_each_run_logged_as_its_folder_records_it(tmp_path, capsys):
    """A run trained with W&B offline (by hand, or WANDB_MODE=offline) is no run without W&B, whatever the
    plan's settings say: its config.yaml records the mode it logged with."""
    path = write_plan(tmp_path, methods={"FedAvg": ["configs/algorithms/fedavg.yaml"]}, seeds=[0], tune=None,
                      settings={"alpha": {"0.5": [{"data.alpha": 0.5}]}}, configs=[
                          *yaml.safe_load((REPOSITORY / SMOKE).read_text())["configs"], {"federation.rounds": 1}])
    (point,) = load_plan(path, runs_root=tmp_path / "runs").grid()
    dashboard(path, offline=True, runs_root=tmp_path / "runs")
    assert ("note: W&B lacks 1 of the plan's 1 runs (1 not run yet, with logger.wandb_mode disabled); "
            f"`fl-lightning publish {path} --runs_root {tmp_path / 'runs'}` sends the logs") in capsys.readouterr().out
    main([*point.fit_arguments(), "--logger.wandb_mode", "offline"])
    capsys.readouterr()
    dashboard(path, offline=True, runs_root=tmp_path / "runs")
    assert "note: W&B lacks 1 of the plan's 1 runs (1 logged offline, not sent)" in capsys.readouterr().out
