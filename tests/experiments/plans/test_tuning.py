"""A plan's tuning stage (fl_lightning/experiments/plans/tuning.py): its `tune:` checked, the choice made by
its rule from the tuning runs' figures and written with them, a stale choice made again, and the
smoke plan tuned end to end, locally and as two SLURM array jobs (a stand-in sbatch), stopped and
resumed during its tuning, shared by two sweeps."""

import os
import re
import shutil
import signal
from pathlib import Path

import holds
import processes
import pytest
import yaml
from commands import run_sweep
from hand_written_runs import write_checkpoint
from paths import QUICKSTART, REPOSITORY
from sweeps import TINY, files_of, finish, jobs_find_fl_lightning, start_sweep

from fl_lightning.checkpoint import checkpoint_dir
from fl_lightning.commands.main import main as fl_lightning_main
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.plans.tuning import SELECTION_FILE, NotChosen, TunedGrid
from fl_lightning.experiments.results.table import table
from fl_lightning.experiments.runs import LOG_FILE
from fl_lightning.experiments.sweeps.local import hold_run_folder
from fl_lightning.run_dir import RunDirLock
from fl_lightning.run_logging import MetricsLog, read_metrics

pytestmark = pytest.mark.usefixtures("outside_slurm")  # a sweep here never submits or runs as a task

SMOKE = REPOSITORY / "configs" / "plans" / "smoke.yaml"
TIMEOUT_S = 120
CELL = ("alpha-0.5", "FedAvg")


def write_plan(path: Path, tune: dict, seeds=(0,), extra=(), methods=None) -> Path:
    """A digits plan of 3 rounds with a validation split, FedAvg (and `methods`) tuned by `tune`."""
    plan = {"name": "tuned", "configs": [QUICKSTART, TINY, {"data.validation": 0.2, "federation.eval_every": 1},
                                         *extra],
            "methods": methods or {"FedAvg": [{"algorithm": "fedavg"}]},
            "settings": {"alpha": {"0.5": [{"data.alpha": 0.5}]}}, "seeds": list(seeds),
            "tune": {"seeds": [100], "select": "val_accuracy", **tune}}
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def selection_of(folder: Path) -> dict:
    return yaml.safe_load((folder / SELECTION_FILE).read_text())


# --- the plan's tune: ------------------------------------------------------------------------------

@pytest.mark.parametrize("tune, field, expected", [
    ({"seeds": [0, 100]}, "plan.tune.seeds", "seeds apart from the plan's seeds [0]"),
    ({"seeds": [100, 100]}, "plan.tune.seeds", "distinct seeds"),
    ({"select": None}, "plan.tune.select", "the validation metric the choice is made by"),
    ({"at": "last:0"}, "plan.tune.at", "final, best, last:K"),
    ({"methods": {"FedProx": {"client_optimizer.lr": [0.1]}}}, "plan.tune.methods", "methods of the plan (FedAvg)"),
    ({"methods": {"FedAvg": {"client_optimizer.lr": []}}}, "plan.tune.methods.FedAvg", "a non-empty list"),
    ({"methods": {"FedAvg": {"seed": [1, 2]}}}, "plan.tune.methods.FedAvg", "dotted fit settings other than seed"),
    ({"methods": {"FedAvg": {"data.alpha": [0.1, 0.5]}}}, "plan.tune.methods.FedAvg",
     "data.alpha is set by settings.alpha"),
    ({"methods": {"FedAvg": {"client_optimizer.lr": [0.1, "0.1"]}}}, "plan.tune.methods.FedAvg",
     "values that name distinct folders"),
    ({"methods": {"FedAvg": {"data.root": ["a/b"]}}}, "plan.tune.methods.FedAvg", "values that name distinct folders"),
    ({"at": "final", "rule": "max"}, "plan.tune", "a mapping of seeds, select, methods and optionally at"),
], ids=lambda value: None if isinstance(value, (dict, str)) else str(value))
def test_a_bad_tune_is_refused_when_the_plan_is_read(tune, field, expected, tmp_path):
    plan = write_plan(tmp_path / "plan.yaml", {"methods": {"FedAvg": {"client_optimizer.lr": [0.1, 0.2]}}, **tune})
    with pytest.raises(ConfigError, match=re.escape(expected)) as refused:
        load_plan(plan)
    assert refused.value.field_name == field


def test_a_tuned_plan_without_a_validation_split_or_logging_its_select_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    grid = {"methods": {"FedAvg": {"client_optimizer.lr": [0.1, 0.2]}}}
    plan = write_plan(tmp_path / "plan.yaml", grid, extra=[{"data.validation": None}])
    for command in (["sweep", "--list"], ["table"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            fl_lightning_main([command[0], str(plan), *command[1:], "--runs_root", str(tmp_path / "runs")])
        assert exited.value.code == 2
        assert capsys.readouterr().err == (
            "error: plan.tune: expected tuning runs that hold out a validation split to choose on (data.validation in "
            "the plan's configs, e.g. {data.validation: 0.2}: the test set chooses nothing), got '2 of 2 without one, "
            "first [0] FedAvg (tuning client_optimizer.lr=0.1) | alpha-0.5 | seed 100: data.validation null'\n")
    plan = write_plan(tmp_path / "plan.yaml", {**grid, "select": "test_accuracy"})
    status, out, err = run_sweep(capsys, str(plan), "--dry_run")
    assert status == 2 and out == ""
    assert err == ("error: plan.tune.select: expected a validation metric the tuning runs log (val_accuracy, "
                   "val_loss): the choice is made on the validation split, got 'test_accuracy'\n")


def test_an_override_of_a_tuned_setting_is_refused_and_others_reach_the_tuning_runs(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", {"methods": {"FedAvg": {"client_optimizer.lr": [0.1, 0.2]}}})
    for override in ("client_optimizer.lr=0.3", "client_optimizer={lr: 0.3}"):
        status, out, err = run_sweep(capsys, str(plan), "--list", "--override", override)
        assert status == 2
        assert err.startswith("error: override: expected settings that no setting axis or method of the plan sets ("
                              "client_optimizer"), err
        assert "tune.methods FedAvg: each column or row would train the override's value" in err
    status, out, err = run_sweep(capsys, str(plan), "--dry_run", "--override", "federation.local_steps=1")
    assert status == 0, err
    tuning = [line for line in out.splitlines() if line.startswith(("[0]", "[1]"))]
    assert len(tuning) == 2 and all("--federation.local_steps 1 --out_dir runs/tuned@local_steps1-" in line
                                    and "/tune/alpha-0.5/fedavg/lr=0." in line for line in tuning)


# --- the choice -------------------------------------------------------------------------------------

# A run's select metric at its evaluations, per candidate (lr) and tuning seed (100, 101).
ROWS = {0.1: ([0.875, 0.25], [0.75]), 0.2: ([0.5], [0.5]), 0.3: ([0.25, 0.375], [0.125])}


def record_run(entry, values: list, finished: bool = True) -> None:
    """A tuning run's folder as fit leaves it: its checkpoint (of the last round, or of round 1), its
    config.yaml and metrics.jsonl with `values` as both val_accuracy and val_loss."""
    out_dir = entry.point.out_dir
    write_checkpoint(out_dir, 3 if finished else 1, entry.config)
    (out_dir / "config.yaml").write_text(yaml.safe_dump(entry.config))
    MetricsLog(out_dir, [{"round": number, "train_loss": 1.0, "val_accuracy": value, "val_loss": value}
                         for number, value in enumerate(values, start=1)])


def tuned_grid(tmp_path: Path, select: str = "val_accuracy", at: str = "final", **tune) -> TunedGrid:
    plan = write_plan(tmp_path / "plan.yaml", {"seeds": [100, 101], "select": select, "at": at,
                                               "methods": {"FedAvg": {"client_optimizer.lr": list(ROWS)}}, **tune})
    return TunedGrid(load_plan(plan, runs_root=tmp_path / "runs"))


EDGES = {0.1: "client_optimizer.lr=0.1 is at the lower edge of its grid (0.1 to 0.3): widen it",
         0.3: "client_optimizer.lr=0.3 is at the upper edge of its grid (0.1 to 0.3): widen it"}
"""What the selection file says of a choice at an edge of ROWS."""


@pytest.mark.parametrize("select, at, figures, chosen", [
    # The final rounds' mean over the seeds; 0.1 and 0.2 tie at 0.5: the first in the plan's order.
    ("val_accuracy", "final", [0.5, 0.5, 0.25], 0.1),
    ("val_accuracy", "best", [0.8125, 0.5, 0.25], 0.1),
    ("val_accuracy", "last:2", [0.65625, 0.5, 0.21875], 0.1),
    ("val_loss", "final", [0.5, 0.5, 0.25], 0.3),  # a loss: the lowest
    ("val_loss", "best", [0.5, 0.5, 0.1875], 0.3),
], ids=lambda value: str(value) if isinstance(value, str) else None)
def test_the_choice_is_the_best_mean_over_the_tuning_seeds_the_first_on_a_tie(select, at, figures, chosen, tmp_path,
                                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    grid = tuned_grid(tmp_path, select, at)
    for entry in grid.tuning:
        record_run(entry, ROWS[entry.point.tuned["client_optimizer.lr"]][entry.point.seed - 100])
    assert [point.waiting for point in grid.final_points] == [True]
    selection = grid.choose(CELL, ended=False)
    assert selection.chosen == {"client_optimizer.lr": chosen}
    written = selection_of(grid.plan.tune_folder(*CELL))
    assert written["chosen"] == {"client_optimizer.lr": chosen} and (written["select"], written["at"]) == (select, at)
    assert [candidate["figure"] for candidate in written["candidates"]] == figures
    assert written["edges"] == [EDGES[chosen]] and written["chosen_from"] == "every candidate"
    assert [[run["folder"] for run in candidate["runs"]] for candidate in written["candidates"]] == [
        [str(entry.point.out_dir) for entry in grid.tuning[position:position + 2]] for position in (0, 2, 4)]
    # The plan's own run now takes the choice, after the method's parts; a grid read afresh finds it.
    (point,) = TunedGrid(grid.plan).final_points
    assert not point.waiting and point.parts[-1] == {"client_optimizer.lr": chosen}
    assert point.fit_arguments()[point.fit_arguments().index("--client_optimizer.lr") + 1] == str(chosen)


def test_a_candidate_without_a_figure_is_named_and_never_chosen(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    grid = tuned_grid(tmp_path, choose_from="finished")
    first, second, third, fourth, fifth, sixth = grid.tuning
    record_run(first, [0.25])
    record_run(second, [0.25])
    record_run(third, [0.875])
    record_run(fourth, [0.875], finished=False)  # failed (or stopped) after round 1
    record_run(fifth, [float("nan")])  # diverged
    record_run(sixth, [0.375])
    # While the stage may still be running, a run left unfinished is waited for.
    with pytest.raises(NotChosen) as waiting:
        grid.choose(CELL, ended=False)
    assert waiting.value.reason == (f"[3] FedAvg (tuning client_optimizer.lr=0.2) | alpha-0.5 | seed 101 in "
                                    f"{fourth.point.out_dir} is partial at round 1/3")
    assert not (grid.plan.tune_folder(*CELL) / SELECTION_FILE).exists()
    # Once it is over (tune.choose_from: finished), a candidate with a run that ended unfinished or logged no
    # finite value has no figure.
    selection = grid.choose(CELL, ended=True)
    assert selection.chosen == {"client_optimizer.lr": 0.1}
    written = selection_of(grid.plan.tune_folder(*CELL))
    assert [(c["figure"], c.get("problem")) for c in written["candidates"]] == [
        (0.25, None),
        (None, "seed 101: partial at round 1/3, ended unfinished (cancelled, failed or never run)"),
        (None, "seed 100: no finite val_accuracy logged (diverged?)")]
    assert written["chosen_from"] == "the finished candidates"
    # None left: no choice, and nothing written.
    (grid.plan.tune_folder(*CELL) / SELECTION_FILE).unlink()
    shutil.rmtree(checkpoint_dir(first.point.out_dir))
    record_run(first, [0.25], finished=False)
    with pytest.raises(NotChosen, match="no candidate has a figure: client_optimizer.lr=0.1: seed 100: partial at"):
        TunedGrid(grid.plan).choose(CELL, ended=True)
    assert not (grid.plan.tune_folder(*CELL) / SELECTION_FILE).exists()


def test_a_run_another_sweep_looks_at_is_running_only_while_unfinished_or_its_fit_has_not_exited(tmp_path,
                                                                                                 monkeypatch):
    """A sweep holds each run folder for an instant to see whether it is finished; a sweep choosing
    at that instant took a finished run for a running one, and left the choice to others."""
    monkeypatch.chdir(tmp_path)
    grid = tuned_grid(tmp_path)
    for entry in grid.tuning:
        record_run(entry, ROWS[entry.point.tuned["client_optimizer.lr"]][entry.point.seed - 100])
    first = grid.tuning[0].point
    looking = hold_run_folder(first.out_dir)  # another sweep, looking at the finished run
    try:
        assert grid.choose(CELL, ended=True).chosen == {"client_optimizer.lr": 0.1}
    finally:
        looking.release()
    (grid.plan.tune_folder(*CELL) / SELECTION_FILE).unlink()  # a choice made is not made again
    # The fit that finished it, still writing: the run is running.
    finishing = RunDirLock(first.out_dir)
    finishing.acquire()
    try:
        with pytest.raises(NotChosen, match=r"\[0\] .* is running \(held by pid "):
            TunedGrid(grid.plan).choose(CELL, ended=True)
    finally:
        finishing.release()
    # An unfinished run a sweep holds is running, or about to.
    shutil.rmtree(checkpoint_dir(grid.tuning[1].point.out_dir))
    record_run(grid.tuning[1], [0.25], finished=False)
    looking = hold_run_folder(grid.tuning[1].point.out_dir)
    try:
        with pytest.raises(NotChosen, match=r"\[1\] .* is running \(held by pid "):
            TunedGrid(grid.plan).choose(CELL, ended=True)
    finally:
        looking.release()


@pytest.mark.parametrize("change, reason", [
    ({"select": "val_loss"}, "made with select val_accuracy, the plan's tune says val_loss"),
    ({"seeds": [100, 102]}, "made with tuning seeds [100, 101], the plan's tune says [100, 102]"),
    ({"methods": {"FedAvg": {"client_optimizer.lr": [0.1, 0.2]}}},
     "made from the candidates client_optimizer.lr=0.1, client_optimizer.lr=0.2, client_optimizer.lr=0.3, the "
     "plan's tune has client_optimizer.lr=0.1, client_optimizer.lr=0.2"),
    ({"rounds": 4}, "made from tuning runs of other settings"),
    ({"chosen": {"client_optimizer.lr": 0.3}}, "its chosen values are not those of the best of its figures"),
    ({"garbage": True}, "is unreadable"),
    ({"bytes": True}, "is unreadable (UnicodeDecodeError: "),
], ids=lambda value: next(iter(value)) if isinstance(value, dict) else None)
def test_a_stale_selection_is_never_used_and_is_made_again(change, reason, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    grid = tuned_grid(tmp_path)
    for entry in grid.tuning:
        record_run(entry, ROWS[entry.point.tuned["client_optimizer.lr"]][entry.point.seed - 100])
    grid.choose(CELL, ended=False)
    selection = grid.plan.tune_folder(*CELL) / SELECTION_FILE
    plan = yaml.safe_load(grid.plan.path.read_text())
    if "rounds" in change:
        plan["configs"].append({"federation.rounds": change["rounds"]})  # more rounds would continue the runs
    elif "chosen" in change:
        selection.write_text(selection.read_text().replace("chosen: {client_optimizer.lr: 0.1}",
                                                           "chosen: {client_optimizer.lr: 0.3}"))
    elif "garbage" in change:
        selection.write_text("candidates: 3\n")
    elif "bytes" in change:
        selection.write_bytes(b"chosen: \xff\xfe\n")  # not UTF-8: read as text that is not YAML is
    else:
        plan["tune"].update(change)
    grid.plan.path.write_text(yaml.safe_dump(plan, sort_keys=False))
    stale = TunedGrid(load_plan(grid.plan.path, runs_root=tmp_path / "runs"))
    assert CELL not in stale.made and reason in stale.stale[CELL]
    assert [point.waiting for point in stale.final_points] == [True]
    status, out, err = run_sweep(capsys, str(grid.plan.path), "--runs_root", str(tmp_path / "runs"), "--list")
    assert status == 0, err
    assert re.split(r"\s{2,}", out.splitlines()[-3])[4] == "waiting for tuning"
    assert out.splitlines()[-1].startswith(f"tuning of FedAvg | alpha-0.5: no choice yet ({selection} ")
    assert reason in out.splitlines()[-1]
    # Made again from the runs as they are (those that exist: a new candidate's run would train first).
    if "seeds" not in change and "rounds" not in change:
        remade = stale.choose(CELL, ended=True)
        assert CELL not in stale.stale and TunedGrid(stale.plan).made[CELL].chosen == remade.chosen


def test_a_choice_of_the_first_candidate_trains_the_plans_runs(tmp_path, capsys, monkeypatch):
    """A waiting run stands at its cell's first candidate: once that candidate is chosen, the run has the
    waiting run's command line, and was taken for the waiting run (never trained, listed as both)."""
    monkeypatch.chdir(tmp_path)
    grid = tuned_grid(tmp_path)
    for entry in grid.tuning:
        record_run(entry, ROWS[entry.point.tuned["client_optimizer.lr"]][entry.point.seed - 100])
    assert [entry.point.waiting for entry in grid.final()] == [True]  # resolved while it waits, as a sweep does
    grid.choose_all()
    assert grid.made[CELL].chosen == {"client_optimizer.lr": 0.1}  # the first of the grid
    assert [(entry.point.index, entry.point.waiting) for entry in grid.final()] == [(6, False)]
    assert [entry.point.index for entry in grid.to_run(None, ended=True)] == [6]
    status, out, err = run_sweep(capsys, str(grid.plan.path), "--runs_root", str(tmp_path / "runs"), "--list")
    assert status == 0, err
    assert re.split(r"\s{2,}", out.splitlines()[7])[4] == "not started" and "waiting" not in out


def test_a_choice_is_made_once_when_two_sweeps_or_tasks_come_to_make_it(tmp_path, capsys, monkeypatch):
    """Two array tasks of a cell that find no choice at once: the second, under the cell's lock, finds the
    first's and writes nothing; each logs the choice in a line."""
    monkeypatch.chdir(tmp_path)
    first, second = tuned_grid(tmp_path), None
    for entry in first.tuning:
        record_run(entry, ROWS[entry.point.tuned["client_optimizer.lr"]][entry.point.seed - 100])
    second = TunedGrid(first.plan)  # read before the first chose
    assert CELL not in second.made
    first.choose(CELL, ended=True)
    path = first.plan.tune_folder(*CELL) / SELECTION_FILE
    written = path.stat()
    capsys.readouterr()
    assert second.choose(CELL, ended=True).chosen == {"client_optimizer.lr": 0.1}
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert capsys.readouterr().out == (
        "tuning of FedAvg | alpha-0.5: chose client_optimizer.lr=0.1 (val_accuracy 0.5 at the final round; the "
        "others: client_optimizer.lr=0.2: 0.5, client_optimizer.lr=0.3: 0.25); " + EDGES[0.1] + f"; {path} (made "
        "first by another sweep or task)\n")


@pytest.mark.parametrize("values, edges", [
    ([0.1, 0.2, 0.3], [EDGES[0.1]]),
    ([0.3, 0.1, 0.2], [EDGES[0.1]]),  # the grid's order is not its range
    ([0.05, 0.1, 0.3], []),
    ([0.1, 0.3], []),  # with 2 values every choice is at an end
])
def test_a_choice_at_an_edge_of_its_grid_is_said_under_the_table_and_counted_in_the_list(values, edges, tmp_path,
                                                                                          capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = write_plan(tmp_path / "plan.yaml", {"seeds": [100, 101], "methods": {"FedAvg": {"client_optimizer.lr":
                                                                                             values}}})
    grid = TunedGrid(load_plan(plan, runs_root=tmp_path / "runs"))
    for entry in grid.tuning:
        lr = entry.point.tuned["client_optimizer.lr"]
        record_run(entry, ROWS[lr][entry.point.seed - 100] if lr in ROWS else [0.0])
    grid.choose_all()
    assert selection_of(grid.plan.tune_folder(*CELL)).get("edges", []) == edges
    notes = table(plan=str(plan), runs_root=tmp_path / "runs").notes
    assert [note for note in notes if "edge of its grid" in note] == [f"FedAvg | alpha-0.5: {edge}" for edge in edges]
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(tmp_path / "runs"), "--list")
    assert status == 0, err
    counted = [line for line in out.splitlines() if "at an edge of their grid" in line]
    assert counted == (["1 of 1 tuning choice(s) at an edge of their grid (said above): widen the grid"] if edges
                       else [])


def test_a_tuned_setting_the_method_does_not_read_is_refused_before_anything_trains(tmp_path, capsys, monkeypatch):
    """CTP-FL's clients train no local model: every candidate of client_optimizer.lr would train alike, and
    the first would win the tie."""
    monkeypatch.chdir(tmp_path)
    methods = {"FedAvg": [{"algorithm": "fedavg"}], "CTP-FL": [{"algorithm": "ctpfl"}]}
    plan = write_plan(tmp_path / "plan.yaml", {"methods": {"CTP-FL": {"client_optimizer.lr": [0.1, 0.2]}}},
                      methods=methods)
    for command in (["sweep", "--dry_run"], ["table"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            fl_lightning_main([command[0], str(plan), *command[1:], "--runs_root", str(tmp_path / "runs")])
        assert exited.value.code == 2
        assert capsys.readouterr().err == (
            "error: plan.tune.methods.CTP-FL: expected settings that reach the method's runs (one they do not read "
            "trains every candidate alike, and the first wins the tie), got 'client_optimizer.lr: the runs of CTP-FL "
            "never read it (the clients of CTPFL train no local model)'\n")
    assert not (tmp_path / "runs").exists()
    # What CTP-FL reads is tuned; so is the client optimizer of a method that trains locally.
    plan = write_plan(tmp_path / "plan.yaml", {"methods": {"CTP-FL": {"algorithm.init_args.span": [0.0, 0.5]},
                                                           "FedAvg": {"client_optimizer.lr": [0.1, 0.2]}}},
                      methods=methods)
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(tmp_path / "runs"), "--list")
    assert status == 0, err
    # A candidate that fit refuses is named as a refused point, not taken for a setting that reaches no run.
    plan = write_plan(tmp_path / "plan.yaml", {"methods": {"FedAvg": {"client_optimizer.lr": [-1.0, 0.2]}}})
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(tmp_path / "runs"), "--dry_run")
    assert status == 2 and err.startswith("error: plan: expected grid points whose settings fit accepts"), err


# --- a stage cut short: cancelled on SLURM, chosen from every candidate or from the finished --------

def cancelled_midway(tmp_path: Path, capsys, monkeypatch, **tune) -> tuple[Path, list[str], TunedGrid]:
    """The plan submitted as two array jobs (a stand-in sbatch), then the tuning job cancelled once its
    first 2 of 6 tasks had finished and its third had trained a round: (the submissions' record, the
    sweep's arguments, the grid)."""
    record = stand_in_sbatch(tmp_path, monkeypatch)
    plan = write_plan(tmp_path / "plan.yaml", {"seeds": [100, 101], "methods": {"FedAvg": {"client_optimizer.lr":
                                                                                           list(ROWS)}}, **tune})
    arguments = [str(plan), "--runs_root", str(tmp_path / "runs")]
    status, out, err = run_sweep(capsys, *arguments, "--mode", "submit")
    assert status == 0, err
    assert [line.split()[:2] for line in record.read_text().splitlines()] == [
        ["--array=0-5", "slurm/sweep.sbatch"], ["--array=6-6", "--dependency=afterany:41"]]
    grid = TunedGrid(load_plan(plan, runs_root=tmp_path / "runs"))
    for entry in grid.tuning[:2]:
        record_run(entry, ROWS[0.1][entry.point.seed - 100])
    record_run(grid.tuning[2], [0.5], finished=False)
    return record, arguments, grid


def final_task(capsys, arguments: list[str]) -> tuple[int, str, str]:
    """The second array job's task of the plan's own run: its point's settings, its cell's choice first."""
    return run_sweep(capsys, *arguments, "--mode", "fit_config", "--index", "6", "--tuning_ended", "true")


def test_a_tuning_job_cancelled_midway_chooses_nothing_and_the_next_submission_finishes_it(
        tmp_path, capsys, monkeypatch, in_repository_root):
    record, arguments, grid = cancelled_midway(tmp_path, capsys, monkeypatch)
    # The second job starts at once (afterany): its task fails, naming the stage, and chooses nothing.
    status, out, err = final_task(capsys, arguments)
    assert status == 2 and out == ""
    assert ("got 'an incomplete tuning stage: 4 of 6 tuning run(s) ended unfinished (cancelled, failed or never "
            f"run), first [2] FedAvg (tuning client_optimizer.lr=0.2) | alpha-0.5 | seed 100 in "
            f"{grid.tuning[2].point.out_dir}: partial at round 1/3; submit the plan again to finish them, or choose "
            "from the finished candidates with tune.choose_from: finished'") in err
    assert not (grid.plan.tune_folder(*CELL) / SELECTION_FILE).exists()
    status, out, err = run_sweep(capsys, *arguments, "--mode", "list")
    assert "1 waiting for their tuning choice" in out and "no choice yet, 2 of 6 tuning run(s) finished" in out
    # Submitted again: the tuning runs left unfinished, then the plan's own run after them.
    status, out, err = run_sweep(capsys, *arguments, "--mode", "submit")
    assert status == 0, err
    assert [line.split()[:2] for line in record.read_text().splitlines()[2:]] == [
        ["--array=2-5", "slurm/sweep.sbatch"], ["--array=6-6", "--dependency=afterany:43"]]
    for entry in grid.tuning[2:]:
        shutil.rmtree(entry.point.out_dir, ignore_errors=True)
        record_run(entry, ROWS[entry.point.tuned["client_optimizer.lr"]][entry.point.seed - 100])
    status, out, err = final_task(capsys, arguments)
    assert status == 0, err
    assert "tuning of FedAvg | alpha-0.5: chose client_optimizer.lr=0.1 (val_accuracy 0.5 at the final round" in err
    written = selection_of(grid.plan.tune_folder(*CELL))
    assert [c["figure"] for c in written["candidates"]] == [0.5, 0.5, 0.25]
    assert written["chosen_from"] == "every candidate"


def test_a_plan_that_chooses_from_the_finished_says_so_and_a_complete_stage_replaces_that_choice(
        tmp_path, capsys, monkeypatch, in_repository_root):
    record, arguments, grid = cancelled_midway(tmp_path, capsys, monkeypatch, choose_from="finished")
    status, out, err = final_task(capsys, arguments)
    assert status == 0, err
    finished_only = "chosen from the finished candidates only (1 of 3: tune.choose_from: finished)"
    assert "tuning of FedAvg | alpha-0.5: chose client_optimizer.lr=0.1 (val_accuracy 0.5 at the final round" in err
    assert finished_only in err  # the job's log
    written = selection_of(grid.plan.tune_folder(*CELL))
    assert written["chosen_from"] == "the finished candidates"
    assert [c.get("problem", "")[:30] for c in written["candidates"]] == ["", "seed 100: partial at round 1/3",
                                                                          "seed 100: not started, ended u"]
    assert f"FedAvg | alpha-0.5: {finished_only}" in table(plan=arguments[0], runs_root=tmp_path / "runs").notes
    # The plan back to choosing from every candidate: that choice is stale, and its stage is finished first.
    plan = yaml.safe_load(Path(arguments[0]).read_text())
    del plan["tune"]["choose_from"]
    Path(arguments[0]).write_text(yaml.safe_dump(plan, sort_keys=False))
    stale = TunedGrid(load_plan(Path(arguments[0]), runs_root=tmp_path / "runs"))
    assert "made from the finished candidates only, and the plan's tune chooses from every candidate" in \
        stale.stale[CELL]
    status, out, err = run_sweep(capsys, *arguments, "--mode", "submit")
    assert status == 0, err
    assert record.read_text().splitlines()[2].split()[0] == "--array=2-5"


def test_a_bad_choose_from_is_refused(tmp_path):
    plan = write_plan(tmp_path / "plan.yaml", {"choose_from": "some", "methods": {"FedAvg": {"client_optimizer.lr":
                                                                                               [0.1, 0.2]}}})
    with pytest.raises(ConfigError, match=re.escape("plan.tune.choose_from: expected one of all, finished")):
        load_plan(plan)


# --- the smoke plan, end to end ----------------------------------------------------------------------

SMOKE_METHODS = {"FedAvg": "fedavg", "FedAvg + CONST": "fedavg+const"}
"""The smoke plan's methods, both tuned, and their folders."""


def check_smoke_choices(runs: Path) -> dict:
    """Each method's choice in each split, from its selection.yaml (the best of its candidates' figures),
    and its runs made with it; method -> setting -> the lr chosen."""
    chosen: dict = {}
    for method, folder in SMOKE_METHODS.items():
        for setting in ("alpha-0.5", "alpha-0.1"):
            written = selection_of(runs / "smoke" / "tune" / setting / folder)
            assert [c["values"] for c in written["candidates"]] == [{"client_optimizer.lr": lr}
                                                                   for lr in (0.05, 0.2, 0.5)]
            assert all(c["figure"] == c["runs"][0]["value"] for c in written["candidates"])  # one tuning seed
            best = max(written["candidates"], key=lambda c: c["figure"])
            assert written["chosen"] == best["values"]
            lr = chosen.setdefault(method, {})[setting] = best["values"]["client_optimizer.lr"]
            for seed in (0, 1, 2):
                run = runs / "smoke" / setting / folder / f"seed{seed}"
                assert yaml.safe_load((run / "config.yaml").read_text())["client_optimizer"]["lr"] == lr
                assert [row["round"] for row in read_metrics(run)] == [1, 2, 3]
    return chosen


def check_smoke_table(runs: Path, chosen: dict) -> None:
    """The smoke plan's table counts every seed and names each method's choices under it."""
    result = table(plan=str(SMOKE), runs_root=runs)
    assert all(cell.n == 3 for cell in result.cells.values()), result.notes
    expected = []
    for method, folder in SMOKE_METHODS.items():
        first, second = chosen[method]["alpha-0.5"], chosen[method]["alpha-0.1"]
        values = (f"client_optimizer.lr={first} in every setting" if first == second else
                  f"client_optimizer.lr={first} (alpha-0.5), client_optimizer.lr={second} (alpha-0.1)")
        expected.append(f"tuned {method} on seed(s) 100 by the best val_accuracy at the final round (every candidate's "
                        f"figure in {runs}/smoke/tune/<setting>/{folder}/selection.yaml): {values}")
    edges = {0.05: "lower", 0.5: "upper"}
    expected += [f"{method} | {setting}: client_optimizer.lr={lr} is at the {edges[lr]} edge of its grid (0.05 to "
                 "0.5): widen it" for setting in ("alpha-0.5", "alpha-0.1") for method in SMOKE_METHODS
                 if (lr := chosen[method][setting]) in edges]
    assert result.notes == expected


@pytest.mark.slow
def test_the_smoke_plan_tunes_then_trains_its_seeds_at_the_values_chosen(tmp_path, capsys, in_repository_root,
                                                                         forked_runs):
    runs = tmp_path / "runs"
    status, out, err = run_sweep(capsys, str(SMOKE), "--runs_root", str(runs))
    assert status == 0, err
    lines = out.splitlines()
    stage = lines.index("tuning stage: 12 tuning run(s) of 4 cell(s)")
    chose = [number for number, line in enumerate(lines) if line.startswith("tuning of FedAvg")]
    finals = [number for number, line in enumerate(lines) if re.match(r"\[(\d+)\] started", line)
              and int(re.match(r"\[(\d+)\]", line).group(1)) >= 12]
    assert len(chose) == 4 and stage < min(chose) and max(chose) < min(finals)  # the stage, the choices, the seeds
    assert lines[-1] == "12 finished, 0 failed, 0 skipped"
    chosen = check_smoke_choices(runs)
    check_smoke_table(runs, chosen)
    status, out, err = run_sweep(capsys, str(SMOKE), "--runs_root", str(runs), "--list")
    assert status == 0, err
    assert "24 runs: 24 finished, 0 partial, 0 without a checkpoint" in out
    assert (f"tuning of FedAvg + CONST | alpha-0.1: chose client_optimizer.lr={chosen['FedAvg + CONST']['alpha-0.1']} "
            "(val_accuracy ") in out
    # Run again: nothing trains, and the tuning runs of a cell with its choice are not even looked at.
    before = files_of(runs)
    status, out, err = run_sweep(capsys, str(SMOKE), "--runs_root", str(runs))
    assert status == 0, err
    assert out.count("tuning runs are not run again") == 4
    assert out.splitlines()[-1] == "0 finished, 0 failed, 12 skipped"
    assert files_of(runs) == before


def stand_in_sbatch(tmp_path: Path, monkeypatch) -> Path:
    """sbatch on PATH recording each submission's arguments (a line of them), answering with job ids 41, 42, ..."""
    record = tmp_path / "submissions.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$*" >> {record}\n'
                                    f'echo "Submitted batch job $(( 40 + $(wc -l < {record}) ))"\n')
    (bin_dir / "sbatch").chmod(0o755)
    jobs_find_fl_lightning(monkeypatch)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return record


def run_array_task(capsys, sweep_arguments: list[str], index: int) -> None:
    """What an array task of slurm/sweep.sbatch runs (tests/integration/test_slurm.py checks the script does so): the
    point's settings resolved into its folder, then fit on them (here in this process)."""
    status, out, err = run_sweep(capsys, *sweep_arguments, "--index", str(index), "--fit_config", "true")
    assert status == 0, err
    fl_lightning_main(["fit", "--config", out.strip(), "--resume", "auto"])


@pytest.mark.slow
def test_the_smoke_plan_tunes_on_slurm_as_two_array_jobs_the_second_after_the_first(tmp_path, capsys, monkeypatch,
                                                                                     in_repository_root):
    record = stand_in_sbatch(tmp_path, monkeypatch)
    runs = str(tmp_path / "runs")
    status, out, err = run_sweep(capsys, str(SMOKE), "--runs_root", runs, "--slurm")
    assert status == 0, err
    tuning, final = (line.split() for line in record.read_text().splitlines())
    assert tuning == ["--array=0-11", "slurm/sweep.sbatch", str(SMOKE), "--runs_root", runs]
    assert final == ["--array=12-23", "--dependency=afterany:41", "slurm/sweep.sbatch", str(SMOKE), "--runs_root",
                     runs, "--tuning_ended", "true"]
    assert "12 tuning runs as one array job: sbatch --array=0-11 " in out
    assert ("12 grid points as one array job after it (afterany: each task makes its setting's tuning choice "
            "first)") in out
    # A task of the second job before the tuning job ran: no choice to make, nothing resolved.
    status, out, err = run_sweep(capsys, str(SMOKE), "--runs_root", runs, "--index", "12", "--fit_config", "true",
                                 "--tuning_ended", "true")
    assert status == 2 and out == "" and "got 'an incomplete tuning stage: 3 of 3 tuning run(s) ended unfinished " \
        "(cancelled, failed or never run), first [0] FedAvg (tuning client_optimizer.lr=0.05) | alpha-0.5 | seed 100 " \
        "in " in err
    assert not (tmp_path / "runs" / "smoke" / "tune" / "alpha-0.5" / "fedavg" / SELECTION_FILE).exists()
    # The tuning job's tasks, then the second's, each as slurm/sweep.sbatch runs it.
    for index in range(12):
        run_array_task(capsys, [str(SMOKE), "--runs_root", runs], index)
    for index in range(12, 24):
        run_array_task(capsys, [str(SMOKE), "--runs_root", runs, "--tuning_ended", "true"], index)
    check_smoke_table(tmp_path / "runs", check_smoke_choices(tmp_path / "runs"))
    # Submitted again with every choice made: no tuning job, the second one alone.
    status, out, err = run_sweep(capsys, str(SMOKE), "--runs_root", runs, "--slurm")
    assert status == 0, err
    assert record.read_text().splitlines()[-1].split()[:2] == ["--array=12-23", "slurm/sweep.sbatch"]


# --- stopped, resumed, shared, failed ----------------------------------------------------------------

def two_candidates(tmp_path: Path) -> Path:
    """FedAvg's lr 0.05 or 0.5 on seed 100, then seed 0; a run held after round 1 while its folder has `hold`."""
    return write_plan(tmp_path / "plan.yaml", {"methods": {"FedAvg": {"client_optimizer.lr": [0.05, 0.5]}}},
                      extra=[{"callbacks": [holds.hold_after(1)]}])


def log_starts(point) -> int:
    """How many times a sweep started the point's run."""
    return (point.out_dir / LOG_FILE).read_text().count("=== ")


@pytest.mark.slow
def test_a_sweep_stopped_during_tuning_continues_it_then_trains_the_seeds(tmp_path, capsys, monkeypatch,
                                                                          forked_runs):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", holds.pythonpath())
    plan, runs = two_candidates(tmp_path), tmp_path / "runs"
    first, held = load_plan(plan, runs_root=runs).tuning_grid()
    held.out_dir.mkdir(parents=True)
    (held.out_dir / "hold").touch()
    process, output, errors = start_sweep(tmp_path, "sweep", "--plan", str(plan), "--runs_root", str(runs))
    try:
        processes.wait_until(lambda: "[0] finished at round 3" in output.read_text()
                             and (checkpoint_dir(held.out_dir) / "round_000001.ckpt").exists(), [process],
                             "the first tuning run finished and the second checkpointed round 1", TIMEOUT_S)
        process.send_signal(signal.SIGINT)
        assert finish(process) == 130, errors.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    out = output.read_text()
    assert "[1] stopped at round 2" in out and "tuning of" not in out and "[2]" not in out
    assert not (runs / "tuned" / "tune" / "alpha-0.5" / "fedavg" / SELECTION_FILE).exists()
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(runs), "--list")
    assert [re.split(r"\s{2,}", line)[4] for line in out.splitlines()[1:4]] == [
        "finished", "partial at round 2/3", "waiting for tuning"]
    # The same command: the stopped tuning run continues, then the choice, then the plan's seed.
    (held.out_dir / "hold").unlink()
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(runs))
    assert status == 0, err
    assert "[0] skipped, finished (round 3)" in out and "[1] finished at round 3" in out
    assert "tuning of FedAvg | alpha-0.5: chose client_optimizer.lr=0.5 (" in out and "[2] finished at round 3" in out
    final = TunedGrid(load_plan(plan, runs_root=runs)).final_points[0]
    for point, starts in ((first, 1), (held, 2), (final, 1)):  # nothing trained twice
        assert [row["round"] for row in read_metrics(point.out_dir)] == [1, 2, 3]
        assert log_starts(point) == starts


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_sweeps_share_the_tuning_stage_and_choose_once_it_is_over(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", holds.pythonpath())
    plan, runs = two_candidates(tmp_path), tmp_path / "runs"
    held, other = load_plan(plan, runs_root=runs).tuning_grid()
    held.out_dir.mkdir(parents=True)
    (held.out_dir / "hold").touch()
    options = ("--plan", str(plan), "--runs_root", str(runs))
    first, first_out, first_err = start_sweep(tmp_path, "first", *options)
    second = None
    try:
        processes.wait_until(lambda: (checkpoint_dir(held.out_dir) / "round_000001.ckpt").exists(), [first],
                             "the first sweep's tuning run [0] checkpointed round 1", TIMEOUT_S)
        # The second sweep takes the other tuning run, then waits for [0] before it chooses.
        second, second_out, second_err = start_sweep(tmp_path, "second", *options)
        processes.wait_until(lambda: "waiting for 1 tuning run(s) running elsewhere before choosing: [0]"
                             in second_out.read_text(), [first, second], "the second sweep waiting for [0]", TIMEOUT_S)
        assert "[1] finished at round 3" in second_out.read_text() and "tuning of" not in second_out.read_text()
        (held.out_dir / "hold").unlink()
        assert finish(first) == 0, first_err.read_text()
        assert finish(second) == 0, second_err.read_text()
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
    chosen = "tuning of FedAvg | alpha-0.5: chose client_optimizer.lr=0.5 ("
    assert chosen in first_out.read_text() and chosen in second_out.read_text()  # the same choice, made by both
    final = TunedGrid(load_plan(plan, runs_root=runs)).final_points[0]
    for point in (held, other, final):  # each trained once, by one of the sweeps
        assert [row["round"] for row in read_metrics(point.out_dir)] == [1, 2, 3] and log_starts(point) == 1


@pytest.mark.slow
def test_a_failed_candidate_is_not_chosen_and_a_changed_choice_never_resumes_an_old_run(tmp_path, capsys,
                                                                                         monkeypatch, forked_runs):
    monkeypatch.chdir(tmp_path)
    # A batch larger than every client: fit refuses it once the data is split (exit status 2).
    plan = write_plan(tmp_path / "plan.yaml", {"methods": {"FedAvg": {"federation.batch_size": [100000, 16]}}})
    runs = tmp_path / "runs"
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(runs))
    assert status == 1
    assert "[0] FAILED with exit status 2: FedAvg (tuning federation.batch_size=100000) | alpha-0.5 | seed 100" in err
    assert "tuning of FedAvg | alpha-0.5: chose federation.batch_size=16 (val_accuracy " in out
    failed = TunedGrid(load_plan(plan, runs_root=runs)).tuning[0].point.out_dir
    assert f"the others: federation.batch_size=100000: seed 100: failed (its log: {failed / LOG_FILE})" in out
    final = TunedGrid(load_plan(plan, runs_root=runs)).final_points[0]
    assert yaml.safe_load((final.out_dir / "config.yaml").read_text())["federation"]["batch_size"] == 16
    # The plan's tune edited: its choice is stale, made again (batch 8), and the run of batch 16 is refused.
    plan.write_text(plan.read_text().replace("- 16", "- 8"))
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(runs))
    assert status == 2
    assert "is stale: made from the candidates federation.batch_size=100000, federation.batch_size=16, the plan's " \
           "tune has federation.batch_size=100000, federation.batch_size=8" in err
    assert "tuning of FedAvg | alpha-0.5: chose federation.batch_size=8 (" in out
    assert err.splitlines()[-1] == (f"  [2] FedAvg | alpha-0.5 | seed 0 in {final.out_dir}: federation.batch_size "
                                    "16 -> 8 (the checkpoint of round 3)")
    assert log_starts(final) == 1
