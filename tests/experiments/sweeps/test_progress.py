"""A sweep's progress: a local sweep prints a line at a time (runs finished, each running run's round, the time
left at the pace logged so far), and --list shows each run's round and time left from its folder."""

import re

import pytest
import yaml
from commands import run_sweep
from hand_written_runs import write_checkpoint
from sweeps import log_rounds, write_plan

from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.plans.resolve import resolve_grid
from fl_lightning.experiments.sweeps import progress as progress_module
from fl_lightning.experiments.sweeps.progress import ProgressLines, RunLeft, seconds_left

pytestmark = pytest.mark.usefixtures("outside_slurm")  # a sweep here never submits or runs as a task


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_local_sweeps_progress_is_a_line_at_a_time_with_the_time_left(tmp_path):
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [], "FedProx": [{"algorithm": "fedprox"}]}, seeds=[0, 1])
    points = load_plan(plan, runs_root=tmp_path / "runs").grid()
    rounds = {point.index: 10 for point in points}
    clock = Clock()
    progress = ProgressLines(rounds, {point.index: 0 for point in points}, jobs=2, total=4, clock=clock)
    running, pending = points[:2], points[2:]
    assert progress.line(running, pending, finished=0, failed=0) is None  # no round yet
    # The first round of a run is said at once: its pace (after the first, warm-up, round) gives the
    # time it has left, and, for runs of its method yet to start, theirs.
    log_rounds(points[0].out_dir, [9.0, 2.0, 4.0])
    clock.now += 1
    assert progress.line(running, pending, 0, 0) == (
        "progress: 0/4 runs finished; running [0] round 3/10 (21 s left), [1] round 0/10 (- left); the sweep: "
        # [0] 7 x 3 s and [1] 10 x 3 s (FedAvg's pace); FedProx's runs, at the only pace there is: 20 x 3 s
        f"{(7 + 10 + 20) * 3 / 2:.0f} s left (their rounds alone until a run has finished)")
    # More rounds: a line when PROGRESS_SECONDS have passed, not before (nor without a new round).
    log_rounds(points[0].out_dir, [9.0, 2.0, 4.0, 3.0])
    clock.now += 1
    assert progress.line(running, pending, 0, 0) is None
    clock.now += progress_module.PROGRESS_SECONDS
    assert progress.line(running, pending, 0, 0).startswith("progress: 0/4 runs finished; running [0] round 4/10 ")
    clock.now += progress_module.PROGRESS_SECONDS
    assert progress.line(running, pending, 0, 0) is None
    # [0] finished, [1] failed: the sweep's time left is its pending runs'.
    log_rounds(points[2].out_dir, [5.0, 8.0])
    clock.now += 1
    assert progress.line(points[2:3], points[3:], finished=1, failed=1) == (
        "progress: 1/4 runs finished, 1 failed; running [2] round 2/10 (64 s left); the sweep: "
        f"{(8 * 8 + 10 * 8) / 2:.0f} s left (their rounds alone until a run has finished)")


def test_list_shows_each_runs_round_and_time_left_from_its_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [{"algorithm": "fedavg"}]}, seeds=[0, 1, 2])
    runs = tmp_path / "runs"
    first, second, third = resolve_grid(load_plan(plan, runs_root=runs).grid())
    # As SLURM tasks leave them: [0] finished, [1] checkpointed round 1 and logged round 2 since.
    for entry, checkpointed, seconds in ((first, 3, [1.0, 2.0, 2.0]), (second, 1, [3.0, 4.0])):
        out_dir = entry.point.out_dir
        write_checkpoint(out_dir, checkpointed, entry.config)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(entry.config))
        log_rounds(out_dir, seconds)
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), "--list")
    assert status == 0, err
    rows = [re.split(r"\s{2,}", line)[4:] for line in out.splitlines()]
    assert rows[1] == ["finished", str(first.point.out_dir), "3/3", "-"]
    assert rows[2] == ["partial at round 1/3", str(second.point.out_dir), "2/3", "4 s"]  # 1 round left at 4 s
    assert rows[3] == ["not started", str(third.point.out_dir), "-", "-"]
    # [1]'s round and [2]'s three at FedAvg's pace (4 s, and 2 s): 1 x 4 + 3 x 3
    assert out.splitlines()[-1] == ("training left: about 13 s one run at a time, at the pace of the rounds logged "
                                    "by 2 run(s) (a run not started yet at its method's)")


def test_runs_yet_to_start_are_counted_with_what_the_finished_runs_took_besides_their_rounds(tmp_path):
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": []}, seeds=[0, 1, 2, 3])
    points = load_plan(plan, runs_root=tmp_path / "runs").grid()
    clock = Clock()
    progress = ProgressLines({point.index: 3 for point in points}, {point.index: 0 for point in points}, jobs=1,
                             total=4, clock=clock)
    # [0] trained its 3 rounds (a warm-up round of 9 s, then 3 s a round) in 20 s from its start to its
    # exit: 20 - 3 x 3 = 11 s besides its rounds at its pace (start-up, warm-up, checkpoints, exit).
    log_rounds(points[0].out_dir, [9.0, 2.0, 4.0])
    progress.run_ended(points[0], 20.0)
    # [1] is at round 2; [2] and [3] have yet to start.
    log_rounds(points[1].out_dir, [8.0, 3.0])
    clock.now += 1
    assert progress.line(points[1:2], points[2:], finished=1, failed=0) == (
        "progress: 1/4 runs finished; running [1] round 2/3 (3 s left); the sweep: "
        f"{1 * 3 + 2 * (3 * 3 + 11):.0f} s left")


def test_the_time_left_adds_what_a_run_takes_besides_its_rounds_to_each_run_yet_to_start():
    runs = [RunLeft("FedAvg", 2, 3.0), RunLeft("FedAvg", 3, None, starting=True),
            RunLeft("FedProx", 3, None, starting=True)]
    # 2 x 3 s; then 3 rounds at FedAvg's 3 s, and at the only pace there is, each with 5 s besides.
    assert seconds_left(runs, besides_rounds=5.0) == 2 * 3 + 2 * (3 * 3 + 5)
    assert seconds_left(runs) == 2 * 3 + 2 * 3 * 3
    assert seconds_left([RunLeft("FedAvg", 3, None, starting=True)], besides_rounds=5.0) is None


def test_the_tuning_stages_time_left_counts_the_runs_of_the_plan_that_follow_it(tmp_path):
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": []}, seeds=[0, 1])
    points = load_plan(plan, runs_root=tmp_path / "runs").grid()
    clock = Clock()
    # The stage's two runs, then 3 runs of 3 rounds of the plan's own (of FedAvg: the stage's pace, 3 s).
    then = [RunLeft("FedAvg", 3, None, starting=True)] * 3
    progress = ProgressLines({point.index: 3 for point in points}, {point.index: 0 for point in points}, jobs=1,
                             total=2, clock=clock, then=then)
    log_rounds(points[0].out_dir, [9.0, 2.0, 4.0])
    progress.run_ended(points[0], 20.0)  # 11 s besides its rounds
    log_rounds(points[1].out_dir, [8.0, 3.0])
    clock.now += 1
    assert progress.line(points[1:2], [], finished=1, failed=0) == (
        "progress: 1/2 runs finished; running [1] round 2/3 (3 s left); the sweep: "
        f"{1 * 3 + 3 * (3 * 3 + 11):.0f} s left (with the 3 run(s) of its next stage)")
