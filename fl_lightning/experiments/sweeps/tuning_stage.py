"""A plan's tuning stage run: locally, every tuning run of the cells still to choose and then each cell's
choice (fl_lightning.experiments.plans.tuning: the rule); on SLURM, the tuning runs as one array job and the
plan's own runs as a second that starts once the first has ended."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fl_lightning.experiments.plans.plan import GridPoint
from fl_lightning.experiments.plans.resolve import ResolvedPoint, read_states
from fl_lightning.experiments.plans.tune_grid import describe_candidate
from fl_lightning.experiments.plans.tuning import TunedGrid
from fl_lightning.experiments.runs import POLL_SECONDS, held_elsewhere
from fl_lightning.experiments.sweeps.local import StopRequest, run_locally
from fl_lightning.experiments.sweeps.machine import SweepOptions
from fl_lightning.experiments.sweeps.slurm import submit


def _unfinished(resolved: list[ResolvedPoint]) -> list[ResolvedPoint]:
    """The plan's own runs still to train after the tuning stage (its progress lines count them)."""
    states = read_states(resolved)
    return [entry for entry in resolved if not states[entry.point.index].finished]


def run_tuning_stage(grid: TunedGrid, options: SweepOptions) -> int:
    """Locally: every tuning run of the cells still to choose, until each has finished or failed here
    (a run that another sweep holds is waited for, then taken when left unfinished), then every
    cell's choice. The stage's exit status: 1 when a tuning run failed, 128 + N when signal N
    stopped it (nothing is chosen then)."""
    for cell, selection in grid.made.items():
        print(f"tuning of {cell[1]} | {cell[0]}: chose {describe_candidate(selection.chosen)} already "
              f"({selection.path}); its tuning runs are not run again", flush=True)
    status = 0
    while pending := grid.tuning_to_run():
        print(f"tuning stage: {len(pending)} tuning run(s) of {len({e.point.cell for e in pending})} cell(s)",
              flush=True)
        outcome = run_locally(pending, read_states(pending), options, on_terminal=False, then=_unfinished(grid.final()))
        if outcome.interrupted or options.dry_run:
            return outcome.status
        status = max(status, outcome.status)
        grid.failed |= {point.index for point in outcome.failed}
        if not outcome.elsewhere:
            break
        stopped = _wait_for(outcome.elsewhere)
        if stopped:
            return stopped
    grid.choose_all()
    return status


def _wait_for(points: list[GridPoint]) -> int:
    """Wait until no other process holds these run folders; 128 + N when signal N came first, else 0."""
    print(f"waiting for {len(points)} tuning run(s) running elsewhere before choosing: "
          + ", ".join(f"[{point.index}]" for point in points), flush=True)
    with StopRequest().installed() as stop:
        while any(held_elsewhere(point.out_dir) for point in points) and not stop.signals:
            time.sleep(POLL_SECONDS)
    if stop.signals:
        print(f"interrupted by {stop.signals[0].name} while waiting for the tuning runs elsewhere: run the same "
              "command again to continue", file=sys.stderr, flush=True)
        return 128 + stop.signals[0]
    return 0


def submit_stages(plan_path: Path, grid: TunedGrid, options: SweepOptions) -> None:
    """With --slurm: the unfinished tuning runs of the cells still to choose as one array job (those of a
    stage cancelled midway among them), then the plan's own runs as a second, which starts once the
    first has ended (afterany) and whose tasks each make their cell's choice first (--tuning_ended),
    from a complete stage (or as tune.choose_from says)."""
    final = [point.index for point in grid.final_points]
    to_choose = grid.tuning_to_run()
    states = read_states(to_choose)
    tuning = [entry.point.index for entry in to_choose if not states[entry.point.index].finished]
    if not tuning:
        submit(plan_path, final, options)
        return
    job = submit(plan_path, tuning, options, what="tuning runs")
    submit(plan_path, final, options, after=job or "TUNING_JOB_ID", tuning_ended=True)
