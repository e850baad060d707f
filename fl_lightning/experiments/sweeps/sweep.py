"""`fl-lightning sweep`: every run of a plan (see plan.py), on this machine (local.py) or as one SLURM
array job (slurm.py).

Grid point I is `fl-lightning fit` with the point's settings in its own run folder
runs/<plan>/<setting>/<method>/seed<k>, with `--resume auto`. What a run folder holds decides what
happens to it: a finished run (its newest good checkpoint is at the plan's last round, or records a
final stop such as an early stop) is skipped without starting a process, an unfinished one continues
from its checkpoint, a new one starts. So the same command, run again after a crash, a Ctrl-C, a
failed run or on another machine (a laptop, then a cluster), completes the grid without training
anything twice; several sweeps of one plan at once split the grid between them (local.py).

Before anything runs or is submitted, the whole plan is checked:

- every point's settings, as `fit` checks them (resolve.py): a typo or a bad value in one method is
  refused at once, naming the plan, the point and the field;
- every run folder that holds a run, against its point's settings, as `fit` checks them before it
  resumes: a folder holding another experiment (the plan was edited after its run: another alpha, a
  fixed learning rate) would otherwise be skipped as finished or resumed, and its numbers tabulated
  as the plan's. Every such folder is listed with the fields that differ, and the sweep refuses to start.

A plan with `tune:` runs its tuning stage first (tuning.py): locally every tuning run, then each
setting's choice, then the plan's own runs with it; with --slurm two array jobs, the second after
the first. Its grid points are the tuning runs (0 to T-1), then the plan's own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal, Optional

from jsonargparse.typing import NonNegativeInt, PositiveInt

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.overrides import describe_overrides, write_variant_file
from fl_lightning.experiments.plans.plan import GridPoint, Plan, load_plan
from fl_lightning.experiments.plans.resolve import (
    ResolvedPoint,
    check_folders,
    check_grid,
    read_states,
)
from fl_lightning.experiments.plans.tuning import TunedGrid, tuned_grid
from fl_lightning.experiments.runs import RunFolder, RunState
from fl_lightning.experiments.sweeps import resources
from fl_lightning.experiments.sweeps.data_check import check_datasets
from fl_lightning.experiments.sweeps.estimate import estimate_plan
from fl_lightning.experiments.sweeps.local import run_locally
from fl_lightning.experiments.sweeps.machine import SweepOptions
from fl_lightning.experiments.sweeps.progress import RunLeft, duration, seconds_left
from fl_lightning.experiments.sweeps.slurm import check_job_finds_fl_lightning, write_fit_config
from fl_lightning.experiments.sweeps.tuning_stage import run_tuning_stage, submit_stages

SweepMode = Literal["run", "list", "estimate", "submit", "fit_config"]
MODE_OPTIONS: dict[str, tuple[str, ...]] = {
    "run": ("jobs", "gpus_per_run", "threads_per_run", "index", "dry_run", "tuning_ended"),
    "list": (),
    "estimate": ("jobs", "gpus_per_run", "threads_per_run"),
    "submit": ("jobs", "gpus_per_run", "threads_per_run", "sbatch_options", "dry_run"),
    "fit_config": ("index", "tuning_ended"),
}
"""Each mode's own options (plan, runs_root and override are every mode's): a mode is one entry here
and one function of MODES."""
MODE_FLAGS = {"list": "list", "estimate": "estimate", "slurm": "submit", "fit_config": "fit_config"}
"""The flags that chose a mode before --mode (`--list`, `--slurm`, ...), kept for the scripts that give them."""


def sweep(
    plan: Path,
    mode: SweepMode = "run",
    jobs: Optional[PositiveInt] = None,
    gpus_per_run: Optional[NonNegativeInt] = None,
    threads_per_run: Optional[PositiveInt] = None,
    index: Optional[NonNegativeInt] = None,
    sbatch_options: Optional[list[str]] = None,
    runs_root: Path = Path("runs"),
    dry_run: bool = False,
    override: Optional[list[str]] = None,
    tuning_ended: bool = False,
    list: bool = False,
    estimate: bool = False,
    slurm: bool = False,
    fit_config: bool = False,
) -> None:
    """Run every grid point of a sweep plan (methods x settings x seeds) that has not finished yet, here or on SLURM.

    Args:
        plan: the plan file (YAML: name, configs, methods, settings, seeds, and optionally reference, metric,
            resources and tune; each key in docs/experiments.md, "The plan file").
        mode: run (train here the points not finished), list (each point's state, round, time left, folder),
            estimate (price the plan before it runs; docs/experiments.md, "The budget before submitting"), submit
            (one SLURM array job of slurm/sweep.sbatch, task I point I; two with tune:) or fit_config (write point
            --index's resolved `fit` settings, what an array task launches). Each mode takes only its own options.
        jobs: runs at a time. Locally (default 1), processes on this machine; submitted, array tasks at
            once (sbatch --array=...%jobs; default: as many as SLURM allows).
        gpus_per_run: GPUs (and ranks) of each run; default the plan's resources.gpus_per_run, else 0 (the CPU,
            one rank). A plan that asks for GPUs is refused where its runs would get none, unless this is given.
            Locally each run gets CUDA_VISIBLE_DEVICES of its own (jobs x gpus_per_run GPUs at most); submitted,
            each array task asks for --gpus-per-node and --ntasks-per-node of this many.
        threads_per_run: CPUs of each run (default: the cores divided by jobs): on the CPU the CPUs it is bound
            to, on GPUs OMP_NUM_THREADS split over its ranks; submitted, each task's --cpus-per-task per rank.
        index: the grid point of fit_config, or run's only point, in the foreground (its output on the terminal).
        sbatch_options: more sbatch options to submit with ([--time=06:00:00, --partition=gpu]; a --time
            overrides the plan's resources.time_per_run).
        runs_root: folder under which run folders go: <runs_root>/<plan>/<setting>/<method>/seed<k>.
        dry_run: print what would be run or submitted, without doing it.
        override: KEY=VALUE settings applied last to every point (repeatable: federation.rounds=20); one that
            changes the experiment makes a variant of the plan, <plan>@<hint>-<digest>, with folders of its own.
        tuning_ended: the tuning stage has ended (the second array job of a submitted plan is told so): a choice
            still to make counts a tuning run left unfinished as ended, not waited for.
        list: an alias of --mode list.
        estimate: an alias of --mode estimate.
        slurm: an alias of --mode submit.
        fit_config: an alias of --mode fit_config.
    """
    mode = chosen_mode(mode, list=list, estimate=estimate, slurm=slurm, fit_config=fit_config)
    check_mode_options(mode, jobs=jobs, gpus_per_run=gpus_per_run, threads_per_run=threads_per_run, index=index,
                       sbatch_options=sbatch_options, dry_run=dry_run, tuning_ended=tuning_ended)
    options = SweepOptions(jobs=jobs, gpus_per_run=gpus_per_run, threads_per_run=threads_per_run, index=index,
                           sbatch_options=sbatch_options or [], runs_root=Path(runs_root), dry_run=dry_run,
                           overrides=[*(override or [])], tuning_ended=tuning_ended)
    loaded = load_plan(Path(plan), runs_root=options.runs_root, overrides=override)
    check_index(Path(plan), index, len(loaded.tuning_grid()) + len(loaded.grid()))
    grid = tuned_grid(loaded)  # its tuning points, then its own with the choices made, in the variant's folders
    if mode != "fit_config":  # its output is the config's path alone, read by slurm/sweep.sbatch
        describe_variant(grid.plan, options.runs_root)
    MODES[mode](Path(plan), grid, options)


def chosen_mode(mode: str, **flags: bool) -> str:
    """--mode, or the mode that one of its old flags (MODE_FLAGS) chose; two that differ are refused."""
    chosen = {MODE_FLAGS[flag] for flag, given in flags.items() if given} | ({mode} if mode != "run" else set())
    if len(chosen) > 1:
        raise ConfigError("mode", "one mode (--mode, or one of --list, --estimate, --slurm, --fit_config)",
                          sorted(chosen))
    return chosen.pop() if chosen else "run"


def check_index(plan: Path, index: Optional[int], size: int) -> None:
    if index is not None and index >= size:
        raise ConfigError("index", f"a grid point of {plan}: 0-{size - 1}", index)


def check_mode_options(mode: str, **given) -> None:
    """Refuse an option that `mode` does not take (MODE_OPTIONS), and fit_config without --index."""
    for name, value in given.items():
        unset = value is None or value is False or value == []  # index 0 is given
        if not unset and name not in MODE_OPTIONS[mode]:
            takes = ", ".join(f"--{option}" for option in MODE_OPTIONS[mode]) or "no option of its own"
            raise ConfigError(name, f"unset with --mode {mode}, which takes {takes}", value)
    if mode == "fit_config" and given.get("index") is None:
        raise ConfigError("index", "the grid point whose settings --mode fit_config writes", None)


def _checked(plan: Path, grid: TunedGrid, options: SweepOptions, submitted: bool = False) -> list[ResolvedPoint]:
    """The grid refused if any point is, its precision and data checked, and the GPUs of its runs set
    (options.gpus_per_run); what every mode but list does first."""
    resolved, loaded = grid.resolved, grid.plan
    check_grid(plan, resolved)
    resources.check_precision(loaded, resolved)
    options.gpus_per_run = resources.gpus_per_run(loaded, resolved, options.gpus_per_run, submitted)
    check_datasets(plan, resolved if options.index is None else [resolved[options.index]])
    return resolved


def _list_mode(plan: Path, grid: TunedGrid, options: SweepOptions) -> None:
    list_points(grid.resolved, grid.describe_cells())


def _estimate_mode(plan: Path, grid: TunedGrid, options: SweepOptions) -> None:
    estimate_plan(grid.plan, _checked(plan, grid, options), options)


def _fit_config_mode(plan: Path, grid: TunedGrid, options: SweepOptions) -> None:
    check_grid(plan, grid.resolved)
    resources.check_precision(grid.plan, grid.resolved)
    chosen = grid.to_run(options.index, options.tuning_ended)
    checked_folders(plan, chosen)
    path = write_fit_config(chosen[0])
    try:
        print(path, flush=True)
    except BrokenPipeError:
        # Its reader, the array task's shell, is gone (the task was cancelled while it started).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        print(f"grid point {options.index}: the job that asked for its settings ({path}) is gone (cancelled?); "
              "nothing to launch", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _submit_mode(plan: Path, grid: TunedGrid, options: SweepOptions) -> None:
    _checked(plan, grid, options, submitted=True)
    checked_folders(plan, grid.to_run(None, options.tuning_ended))
    _write_variant_file(grid.plan, options)
    resources.array_job(grid.plan, options)
    if not options.dry_run:
        check_job_finds_fl_lightning()
    submit_stages(plan, grid, options)


def _run_mode(plan: Path, grid: TunedGrid, options: SweepOptions) -> None:
    _checked(plan, grid, options)
    chosen = grid.to_run(options.index, options.tuning_ended)
    states = checked_folders(plan, chosen)
    _write_variant_file(grid.plan, options)
    status = run_here(plan, grid, chosen, states, options)
    if status != 0:
        raise SystemExit(status)


def _write_variant_file(loaded: Plan, options: SweepOptions) -> None:
    if loaded.variant_overrides and not options.dry_run:
        write_variant_file(options.runs_root / loaded.name, loaded.name, [loaded.path], loaded.variant_overrides)


MODES = {"run": _run_mode, "list": _list_mode, "estimate": _estimate_mode, "submit": _submit_mode,
         "fit_config": _fit_config_mode}


def describe_variant(plan: Plan, runs_root: Path) -> None:
    if not plan.overrides:
        return
    if plan.name != plan.base_name:
        print(f"plan variant {plan.name} of {plan.base_name} ({describe_overrides(plan.overrides)}): its runs "
              f"in {runs_root / plan.name}", flush=True)
        return
    restated = {key: value for key, value in plan.overrides.items() if key in plan.restated}
    why = [f"{describe_overrides(restated)}: what every point has already"] if restated else []
    if len(restated) < len(plan.overrides):
        why.append("the others do not change the experiment" if restated else "no override changes the experiment")
    print(f"overrides {describe_overrides(plan.overrides)}: the plan's own runs ({'; '.join(why)})", flush=True)


def run_here(plan: Path, grid: TunedGrid, chosen: list[ResolvedPoint], states: dict[int, RunState],
             options: SweepOptions) -> int:
    """On this machine: the point of --index alone; else the tuning stage first, then the plan's own
    runs, those of a cell without a choice left waiting. The sweep's exit status."""
    if options.index is not None or grid.plan.tune is None:
        return run_locally(chosen, states, options, on_terminal=options.index is not None).status
    status = run_tuning_stage(grid, options)
    if status > 1:  # stopped by a signal
        return status
    final = [entry for entry in grid.final() if not entry.point.waiting]
    if len(final) < len(grid.final_points):
        print(f"{len(grid.final_points) - len(final)} run(s) of the plan wait for their tuning choice", flush=True)
    return run_locally(final, checked_folders(plan, final), options, on_terminal=False).status or status


def checked_folders(plan: Path, resolved: list[ResolvedPoint]) -> dict[int, RunState]:
    """What the points' run folders hold, each checked to hold the point's experiment or nothing."""
    states = read_states(resolved)
    check_folders(plan, resolved, states)
    return states


def list_points(resolved: list[ResolvedPoint], cells: list[str]) -> None:
    header = ("index", "method", "setting", "seed", "state", "run folder", "round", "left")
    rows, finished, partial, waiting, left = [], 0, 0, 0, []
    for entry in resolved:
        point = entry.point
        state = RunFolder(point.out_dir).state(entry.rounds)
        different = None if entry.config is None or point.waiting else RunFolder(point.out_dir).difference(entry.config,
                                                                                        state)
        if entry.error is not None:
            described = f"settings refused: {entry.error}"
        elif point.waiting:
            described = "waiting for tuning"
            waiting += 1
            left.append(RunLeft(point.method, state.rounds or 0, None))
        elif different is not None:
            described = f"another experiment: {different}"
        else:
            described = state.describe()
            finished += state.finished
            partial += not state.finished and state.round is not None
            left.append(_run_left(point, state))
        reached = "-" if state.round_logged is None else f"{state.round_logged}/{entry.rounds or '?'}"
        rows.append((str(point.index), point.label, point.setting_name, str(point.seed), described,
                     str(point.out_dir), reached, duration(state.seconds_left)))
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    print(f"{len(resolved)} runs: {finished} finished, {partial} partial, "
          f"{len(resolved) - finished - partial - waiting} without a checkpoint"
          + (f", {waiting} waiting for their tuning choice" if waiting else ""))
    for line in cells:
        print(line)
    total = seconds_left(left)
    if total is not None and any(run.rounds_left for run in left):
        timed = sum(run.seconds_per_round is not None for run in left)
        print(f"training left: about {duration(total)} one run at a time, at the pace of the rounds logged by "
              f"{timed} run(s) (a run not started yet at its method's)")


def _run_left(point: GridPoint, state: RunState) -> RunLeft:
    """What the point's run has yet to train (nothing once finished), at its own pace."""
    pace = None if state.pace is None else state.pace.seconds_per_round
    rounds_left = 0 if state.finished else max(state.rounds - (state.round_logged or 0), 0)
    return RunLeft(point.method, rounds_left, pace)
