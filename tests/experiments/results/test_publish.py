"""`fl-lightning publish`: a plan's runs replayed into W&B runs as `fit` would have logged them, checked in
W&B's offline run files (no network), then the plan's report."""

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from paths import REPOSITORY
from wandb_records import history_rows, run_config, run_record, summary

from fl_lightning.commands.main import main
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.run_logging import PUBLISHED_FILE, read_metrics, run_summary

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("in_repository_root")]
ROUNDS = 2
PLAN = {
    "name": "tiny",
    "configs": ["configs/quickstart.yaml", {"model.options": {"hidden": 8, "depth": 1}},
                {"federation.rounds": ROUNDS, "federation.local_steps": 1, "federation.eval_every": 1},
                {"checkpoint.every": 1, "logger.progress_bar": False}],
    "methods": {"FedAvg": ["configs/algorithms/fedavg.yaml"]},
    "settings": {"alpha": {"0.5": [{"data.alpha": 0.5}]}},
    "seeds": [0, 1],
}


def write_plan(folder: Path) -> Path:
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(PLAN))
    return path


@pytest.fixture(scope="module")
def trained_plan(tmp_path_factory) -> Path:
    """The tiny plan's folder (tiny.yaml, runs/): seed 0 trained with W&B offline (the W&B run `fit`
    logs, to compare with), seed 1 without W&B (the shipped settings), once per module."""
    folder = tmp_path_factory.mktemp("plan")
    first, second = load_plan(write_plan(folder), runs_root=folder / "runs").grid()
    with contextlib.chdir(REPOSITORY):
        main([*first.fit_arguments(), "--logger.wandb_mode", "offline"])
        main(second.fit_arguments())
    return folder


@pytest.fixture
def plan_copy(trained_plan, tmp_path) -> Path:
    """The trained plan's copy for one test, its plan file naming its own run folders."""
    shutil.copytree(trained_plan, tmp_path / "plan")
    return tmp_path / "plan"


def run_files(run: Path) -> list[Path]:
    return sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))


def all_run_files(plan: Path) -> list[Path]:
    return sorted((plan / "runs").glob("tiny/*/*/seed*/wandb/offline-run-*/run-*.wandb"))


def publish(plan: Path, *options: str) -> None:
    main(["publish", str(plan / "tiny.yaml"), "--runs_root", str(plan / "runs"), *options])


def test_each_run_is_published_as_the_wandb_run_fit_logs_then_the_report(plan_copy, capsys):
    runs = [point.out_dir for point in load_plan(plan_copy / "tiny.yaml", runs_root=plan_copy / "runs").grid()]
    (logged_by_fit,) = run_files(runs[0])
    assert run_files(runs[1]) == []
    publish(plan_copy, "--offline")
    printed = capsys.readouterr().out
    published = [[file for file in run_files(run) if file != logged_by_fit] for run in runs]
    assert [len(files) for files in published] == [1, 1]
    # The same W&B run as fit's: id, name, group, tags, project and config.
    fits, ours = run_record(logged_by_fit), run_record(published[0][0])
    for field in ("run_id", "display_name", "run_group", "tags", "project"):
        assert getattr(ours, field) == getattr(fits, field), field
    assert run_config(published[0][0]) == run_config(logged_by_fit)
    assert ours.run_id == published[0][0].stem.removeprefix("run-")
    for run, (file,) in zip(runs, published):
        history = read_metrics(run)
        assert [row["_step"] for row in history_rows(file)] == [row["round"] for row in history] == [1, 2]
        for logged, written in zip(history_rows(file), history):
            assert {key: logged[key] for key in written} == written
        assert {key: summary(file)[key] for key in run_summary(history)} == run_summary(history)
        assert json.loads((run / "wandb" / PUBLISHED_FILE).read_text()) == {
            "offline": {"run_id": run_record(file).run_id, "project": "fl-lightning", "round": ROUNDS}}
    assert run_record(published[1][0]).display_name == "fedavg-seed1"
    assert "published 2 of 2 runs\n" in printed
    assert f"wandb sync {published[0][0].parent} {published[1][0].parent}" in printed
    assert (plan_copy / "runs" / "tiny" / "dashboard.json").is_file()
    assert f"\n  fl-lightning publish {plan_copy / 'tiny.yaml'} --runs_root {plan_copy / 'runs'}\n" in printed


def test_a_second_publish_sends_nothing_twice(plan_copy, capsys):
    publish(plan_copy, "--offline")
    written = all_run_files(plan_copy)
    capsys.readouterr()
    publish(plan_copy, "--offline")
    assert all_run_files(plan_copy) == written
    assert "published 0 of 2 runs; not: 2 published before" in capsys.readouterr().out


def test_a_run_under_way_is_published_with_partial_and_again_once_it_has_finished(plan_copy, capsys):
    plan = load_plan(plan_copy / "tiny.yaml", runs_root=plan_copy / "runs")
    point = plan.grid()[1]
    shutil.rmtree(point.out_dir)
    main([*point.fit_arguments(), "--federation.rounds", "1"])
    publish(plan_copy, "--offline")
    assert run_files(point.out_dir) == []
    assert "published 1 of 2 runs; not: 1 under way (--partial publishes them)" in capsys.readouterr().out
    publish(plan_copy, "--offline", "--partial")
    (partial,) = run_files(point.out_dir)
    assert [row["_step"] for row in history_rows(partial)] == [1]
    assert "final_test_accuracy" not in summary(partial)  # a run under way has no final accuracy yet
    main(point.fit_arguments())
    publish(plan_copy, "--offline")
    (finished,) = set(run_files(point.out_dir)) - {partial}
    assert [row["_step"] for row in history_rows(finished)] == [1, 2]  # the newest offline run holds every round
    assert run_record(finished).run_id == run_record(partial).run_id
    assert summary(finished)["final_test_accuracy"] == read_metrics(point.out_dir)[-1]["test_accuracy"]


def test_wandb_mode_offline_publishes_offline_and_disabled_is_refused(plan_copy, capsys, monkeypatch,
                                                                       wandb_reads_the_environment_afresh):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with pytest.raises(SystemExit) as exited:
        publish(plan_copy)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: WANDB_MODE: expected online, offline or unset to publish (disabled sends nothing to W&B), got "
        "'disabled'"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    publish(plan_copy)
    assert "publishing the runs of plan tiny to W&B offline (WANDB_MODE=offline)" in capsys.readouterr().out
    assert len(all_run_files(plan_copy)) == 3  # fit's of seed 0, and one of each run
