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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from jsonargparse.typing import NonNegativeInt, PositiveInt

from fl_lightning.errors import ConfigError
from fl_lightning.experiments import resources
from fl_lightning.experiments.data_check import check_datasets
from fl_lightning.experiments.estimate import estimate_plan
from fl_lightning.experiments.local import run_locally
from fl_lightning.experiments.overrides import describe_overrides, write_variant_file
from fl_lightning.experiments.plan import GridPoint, Plan, load_plan
from fl_lightning.experiments.progress import RunLeft, duration, seconds_left
from fl_lightning.experiments.resolve import (
    ResolvedPoint,
    check_folders,
    check_grid,
    read_states,
)
from fl_lightning.experiments.runs import RunState, other_experiment, run_state
from fl_lightning.experiments.slurm import write_fit_config
from fl_lightning.experiments.tuning import TunedGrid, run_tuning_stage, submit_stages, tuned_grid


def sweep(
    plan: Path,
    list: bool = False,
    jobs: Optional[PositiveInt] = None,
    gpus_per_run: Optional[NonNegativeInt] = None,
    threads_per_run: Optional[PositiveInt] = None,
    index: Optional[NonNegativeInt] = None,
    slurm: bool = False,
    sbatch_options: Optional[list[str]] = None,
    fit_config: bool = False,
    runs_root: Path = Path("runs"),
    dry_run: bool = False,
    override: Optional[list[str]] = None,
    estimate: bool = False,
    tuning_ended: bool = False,
) -> None:
    """Run every grid point of a sweep plan (methods x settings x seeds) that has not finished yet, here or on SLURM.

    Args:
        plan: the plan file (YAML: name, configs, methods, settings, seeds; see fl_lightning/experiments/plan.py).
        list: print every grid point (index, method, setting, seed, state, run folder) and exit; the state
            (finished, partial at round R, not started, another experiment, settings refused) is read from
            the run folder and the plan, nothing is trained.
        jobs: runs at a time. Locally (default 1), processes on this machine; with --slurm, array tasks at
            once (sbatch --array=...%jobs; default: as many as SLURM allows).
        gpus_per_run: GPUs (and ranks) of each run; default the plan's resources.gpus_per_run, else 0. A
            plan that asks for GPUs is refused where its runs would get none, unless this is given (0
            trains them on the CPU on purpose). 0 runs on the CPU with one rank. Locally each run gets
            CUDA_VISIBLE_DEVICES of its own: jobs x gpus_per_run must not exceed the GPUs visible. With
            --slurm, each array task asks for --gpus-per-node and --ntasks-per-node of this many.
        threads_per_run: CPUs of each run: on the CPU locally the CPUs it is bound to, from which it chooses
            its threads; on GPUs OMP_NUM_THREADS, split over its ranks. Locally by default the cores divided by
            jobs. With --slurm, each task asks for these CPUs (--cpus-per-task per rank).
        index: run grid point INDEX only, in the foreground (its output on the terminal).
        slurm: submit the grid as one SLURM array job of slurm/sweep.sbatch, task I training point I
            (from the repository root, where logs/ receives the tasks' logs).
        sbatch_options: more sbatch options for --slurm, e.g. [--time=06:00:00, --partition=gpu]; a --time
            here overrides the plan's resources.time_per_run.
        fit_config: with --index, write the point's resolved `fit` settings to <run folder>/sweep_fit.yaml,
            print that path and exit without training (what each array task of slurm/sweep.sbatch launches).
        runs_root: folder under which run folders go: <runs_root>/<plan>/<setting>/<method>/seed<k>.
        dry_run: print what would be run or submitted, without doing it.
        override: KEY=VALUE settings applied last to every grid point (repeat --override for several),
            e.g. federation.rounds=20 or data.root=/scratch/data. One that changes the experiment makes a
            variant of the plan, <plan>@<hint>-<digest>, with run folders of its own (printed).
        estimate: time every kind of local step of the grid here (model, data, method), in this process
            and a temporary folder, and print per method and in total the wall and CPU seconds per round,
            CPU core-hours (and GPU-hours), peak memory, client state and checkpoint disk (see
            fl_lightning/experiments/estimate.py); trains nothing of the grid.
        tuning_ended: the tuning stage has ended (the second array job of --slurm is told so): a choice still to
            make counts a tuning run left unfinished as failed, not waited for (fl_lightning/experiments/tuning.py).
    """
    options = SweepOptions(jobs=jobs, gpus_per_run=gpus_per_run, threads_per_run=threads_per_run, index=index,
                           sbatch_options=sbatch_options or [], runs_root=Path(runs_root), dry_run=dry_run)
    loaded = load_plan(Path(plan), runs_root=options.runs_root, overrides=override)
    options.overrides = [*(override or [])]  # `list` is the option here
    check_options(Path(plan), len(loaded.tuning_grid()) + len(loaded.grid()), list=list, index=index, slurm=slurm,
                  fit_config=fit_config, estimate=estimate)
    grid = tuned_grid(loaded)  # its tuning points, then its own with the choices made, in the variant's folders
    resolved = grid.resolved
    if not fit_config:  # its output is the config's path alone, read by slurm/sweep.sbatch
        describe_variant(loaded, options.runs_root)
    if list:
        list_points(resolved, grid.describe_cells())
        return
    check_grid(Path(plan), resolved)
    resources.check_precision(loaded, resolved)
    if not fit_config:
        options.gpus_per_run = resources.gpus_per_run(loaded, resolved, gpus_per_run, slurm)
        check_datasets(Path(plan), resolved if index is None else [resolved[index]])
    if estimate:
        estimate_plan(loaded, resolved, options)
        return
    chosen = grid.to_run(index, tuning_ended)
    states = checked_folders(Path(plan), chosen)
    if loaded.variant_overrides and not (fit_config or dry_run):
        write_variant_file(options.runs_root / loaded.name, loaded.name, [Path(plan)], loaded.variant_overrides)
    if fit_config:
        print(write_fit_config(chosen[0]))
    elif slurm:
        resources.array_job(loaded, options)
        submit_stages(Path(plan), grid, options)
    else:
        status = run_here(Path(plan), grid, chosen, states, options)
        if status != 0:
            raise SystemExit(status)


@dataclass
class SweepOptions:
    jobs: Optional[int] = None
    gpus_per_run: int = 0
    threads_per_run: Optional[int] = None
    index: Optional[int] = None
    sbatch_options: list[str] = field(default_factory=list)
    runs_root: Path = Path("runs")
    dry_run: bool = False
    overrides: list[str] = field(default_factory=list)
    """The command line's --override, as given (passed on to each SLURM array task)."""


def check_options(plan: Path, size: int, *, list: bool, index: Optional[int], slurm: bool, fit_config: bool,
                  estimate: bool) -> None:
    """Refuse options that do not go together, or an index outside the grid of `size` points."""
    if index is not None and index >= size:
        raise ConfigError("index", f"a grid point of {plan}: 0-{size - 1}", index)
    if fit_config and index is None:
        raise ConfigError("fit_config", "true only with --index (the grid point whose settings to write)", fit_config)
    if slurm and (index is not None or fit_config):
        raise ConfigError("slurm", "false with --index or --fit_config (an array job runs every grid point; "
                          "`sbatch --array=I slurm/sweep.sbatch PLAN` reruns task I)", slurm)
    if estimate and (list or slurm or index is not None or fit_config):
        raise ConfigError("estimate", "true without --list, --slurm, --index or --fit_config (it times the plan's "
                          "kinds of local step here: run it on a machine like the cluster's)", estimate)


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
        state = run_state(point.out_dir, entry.rounds)
        different = None if entry.config is None or point.waiting else other_experiment(point.out_dir, entry.config,
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
