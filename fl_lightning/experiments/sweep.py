"""`fl-lightning sweep`: every run of a plan (see plan.py), on this machine or as one SLURM array job.

Grid point I is `fl-lightning fit` with the point's settings in its own run folder
runs/<plan>/<setting>/<method>/seed<k>, with `--resume auto`. What a run folder holds decides what
happens to it: a finished run (its newest good checkpoint is at the plan's last round) is skipped
without starting a process, an unfinished one continues from its checkpoint, a new one starts. So the
same command, run again after a crash, a Ctrl-C, a failed run or on another machine (a laptop, then a
cluster), completes the grid without training anything twice.

- Locally, `--jobs N` runs at a time, each a subprocess `python -m fl_lightning fit ...` writing to
  <run folder>/sweep.log, with its share of the machine: OMP_NUM_THREADS threads on the CPU, or
  CUDA_VISIBLE_DEVICES naming its own GPUs. SIGINT (Ctrl-C) or SIGTERM asks the running runs to
  checkpoint and stop at the end of their round (they get SIGTERM), waits for them and exits 130 / 143;
  a second one kills them at once. A failing run is reported and the others go on; the sweep then exits 1.
- `--slurm` submits one array job of slurm/sweep.sbatch, one task per grid point. Task I asks
  `fl-lightning sweep --index I --fit_config` for the point's settings resolved into one config file
  in its run folder, then launches `srun fl-lightning fit --config <that file>` with the allocation's
  devices, as slurm/fit.sbatch does (slurm/lib.sh: requeue on SIGUSR1, signal forwarding, resume).
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional, Union

from jsonargparse.typing import NonNegativeInt, PositiveInt

from fl_lightning.checkpoint import load_checkpoint, resume_candidates, write_text_atomically
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plan import GridPoint, load_plan
from fl_lightning.run_dir import CONFIG_FILE

LOG_FILE = "sweep.log"
"""Each local run's output, in its run folder (appended to by every attempt)."""
FIT_CONFIG_FILE = "sweep_fit.yaml"
"""A grid point's resolved `fit` settings, written into its run folder for a SLURM array task."""
SWEEP_SCRIPT = Path("slurm") / "sweep.sbatch"
"""The array job's batch script, relative to the repository root (where jobs are submitted from)."""
TAIL_LINES = 15
"""Lines of a failed run's log shown in its report."""
POLL_SECONDS = 0.1
# Set by a launcher for the processes it starts; a local run must not inherit them (it would not be
# rank 0, or would wait for ranks of another job).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")


def sweep(
    plan: Path,
    list: bool = False,
    jobs: Optional[PositiveInt] = None,
    gpus_per_run: NonNegativeInt = 0,
    threads_per_run: Optional[PositiveInt] = None,
    index: Optional[NonNegativeInt] = None,
    slurm: bool = False,
    sbatch_options: Optional[list[str]] = None,
    fit_config: bool = False,
    runs_root: Path = Path("runs"),
    dry_run: bool = False,
) -> None:
    """Run every grid point of a sweep plan (methods x settings x seeds) that has not finished yet, here or on SLURM.

    Args:
        plan: the plan file (YAML: name, configs, methods, settings, seeds; see fl_lightning/experiments/plan.py).
        list: print every grid point (index, method, setting, seed, state, run folder) and exit; the state
            (finished, partial at round R, not started) is read from the run folder, nothing is trained.
        jobs: runs at a time. Locally (default 1), processes on this machine; with --slurm, array tasks at
            once (sbatch --array=...%jobs; default: as many as SLURM allows).
        gpus_per_run: GPUs (and ranks) of each run; 0 runs on the CPU with one rank. Locally each run gets
            CUDA_VISIBLE_DEVICES of its own: jobs x gpus_per_run must not exceed the GPUs visible. With
            --slurm, each array task asks for --gpus-per-node and --ntasks-per-node of this many.
        threads_per_run: CPU threads of each run (OMP_NUM_THREADS, split over its ranks); locally by default
            the cores divided by jobs. With --slurm, each task asks for these CPUs (--cpus-per-task per rank).
        index: run grid point INDEX only, in the foreground (its output on the terminal).
        slurm: submit the grid as one SLURM array job of slurm/sweep.sbatch, task I training point I
            (from the repository root, where logs/ receives the tasks' logs).
        sbatch_options: more sbatch options for --slurm, e.g. [--time=06:00:00, --partition=gpu].
        fit_config: with --index, write the point's resolved `fit` settings to <run folder>/sweep_fit.yaml,
            print that path and exit without training (what each array task of slurm/sweep.sbatch launches).
        runs_root: folder under which run folders go: <runs_root>/<plan>/<setting>/<method>/seed<k>.
        dry_run: print what would be run or submitted, without doing it.
    """
    options = SweepOptions(jobs=jobs, gpus_per_run=gpus_per_run, threads_per_run=threads_per_run, index=index,
                           sbatch_options=sbatch_options or [], runs_root=Path(runs_root), dry_run=dry_run)
    loaded = load_plan(Path(plan), runs_root=options.runs_root)
    points = loaded.grid()
    if index is not None and index >= len(points):
        raise ConfigError("index", f"a grid point of {plan}: 0-{len(points) - 1}", index)
    if fit_config and index is None:
        raise ConfigError("fit_config", "true only with --index (the grid point whose settings to write)", fit_config)
    if slurm and (index is not None or fit_config):
        raise ConfigError("slurm", "false with --index or --fit_config (an array job runs every grid point; "
                          "`sbatch --array=I slurm/sweep.sbatch PLAN` reruns task I)", slurm)
    if list:
        list_points(points)
    elif fit_config:
        print(write_fit_config(points[index]))
    elif slurm:
        submit(Path(plan), points, options)
    else:
        status = run_locally(points if index is None else [points[index]], options, on_terminal=index is not None)
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


# --- what a run folder holds ----------------------------------------------------------------------

@dataclass
class RunState:
    """A run folder as `fit --resume auto` would find it."""

    round: Optional[int]
    """Round of the newest checkpoint that passes its checks; None: there is none."""
    rounds: Optional[int]
    """Rounds the plan asks for; None when the point's settings do not parse."""
    started: bool
    """The run wrote its config.yaml (it got as far as training)."""
    problem: Optional[str] = None
    settings_error: Optional[str] = None
    """Why the point's settings do not parse (then `rounds` is None)."""

    @property
    def finished(self) -> bool:
        """What fit calls a finished run: it would train nothing."""
        return self.round is not None and self.round == self.rounds

    def describe(self) -> str:
        if self.problem is not None:
            state = self.problem
        elif self.finished:
            state = "finished"
        elif self.round is not None:
            state = f"partial at round {self.round}" + (f"/{self.rounds}" if self.rounds is not None else "")
            if self.rounds is not None and self.round > self.rounds:
                state += " (past the plan's rounds: fit refuses it)"
        else:
            state = "started, no checkpoint yet" if self.started else "not started"
        return state + (" (its settings do not parse)" if self.settings_error else "")


def run_state(out_dir: Path, rounds: Optional[int]) -> RunState:
    """Read a run folder's checkpoints (newest first, as `--resume auto` does) and config.yaml; trains nothing."""
    candidates = resume_candidates(out_dir)
    reached, problem = None, None
    for path in candidates:
        try:
            reached = load_checkpoint(path)["round"]
            break
        except ValueError:
            continue
    else:
        if candidates:
            problem = "unusable: every checkpoint fails its checks"
    return RunState(round=reached, rounds=rounds, started=(Path(out_dir) / CONFIG_FILE).is_file(), problem=problem)


def planned_rounds(points: list[GridPoint]) -> dict[int, Union[int, str]]:
    """index -> federation.rounds of the point's settings, or the error its settings give (without training)."""
    from fl_lightning.cli import parser as cli

    parser = cli.build_parser()
    rounds: dict[int, Union[int, str]] = {}
    for point in points:
        try:
            config = cli.parse_command_line(point.fit_arguments(), parser)
            rounds[point.index] = int(config.fit.federation.rounds)
        except ConfigError as err:
            rounds[point.index] = str(err)
    return rounds


def point_states(points: list[GridPoint]) -> dict[int, RunState]:
    states, planned = {}, planned_rounds(points)
    for point in points:
        rounds = planned[point.index]
        parsed = isinstance(rounds, int)
        states[point.index] = run_state(point.out_dir, rounds if parsed else None)
        states[point.index].settings_error = None if parsed else rounds
    return states


def describe_point(point: GridPoint) -> str:
    return f"{point.method} | {point.setting_name} | seed {point.seed}"


def list_points(points: list[GridPoint]) -> None:
    states = point_states(points)
    header = ("index", "method", "setting", "seed", "state", "run folder")
    rows = [(str(p.index), p.method, p.setting_name, str(p.seed), states[p.index].describe(), str(p.out_dir))
            for p in points]
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    finished = sum(state.finished for state in states.values())
    partial = sum(not state.finished and state.round is not None for state in states.values())
    print(f"{len(points)} runs: {finished} finished, {partial} partial, {len(points) - finished - partial} "
          "without a checkpoint")


# --- on SLURM ---------------------------------------------------------------------------------------

def write_fit_config(point: GridPoint) -> Path:
    """The point's `fit` settings, every config fragment and override resolved into one file in its run
    folder (out_dir included), as `fit --print_config` prints them: what an array task launches, so that
    the devices of the allocation, given after it, override whatever the plan sets."""
    from fl_lightning.cli.main import main as command_line

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            command_line([*point.fit_arguments(), "--print_config"])
        except SystemExit as exited:
            if exited.code not in (None, 0):
                raise  # the error line is on stderr
    point.out_dir.mkdir(parents=True, exist_ok=True)
    path = point.out_dir / FIT_CONFIG_FILE
    header = (f"# Grid point {point.index} of plan {point.plan_name} ({describe_point(point)}), resolved by\n"
              f"# `fl-lightning sweep --index {point.index} --fit_config true` for a SLURM array task.\n")
    write_text_atomically(path, header + printed.getvalue())
    return path


def submit(plan_path: Path, points: list[GridPoint], options: SweepOptions) -> None:
    """sbatch --array=0-(N-1)[%jobs] [resources] slurm/sweep.sbatch PLAN --runs_root ROOT"""
    rounds = planned_rounds(points)
    broken = {index: error for index, error in rounds.items() if not isinstance(error, int)}
    if broken:
        index, error = next(iter(broken.items()))
        raise ConfigError("plan", f"grid points whose settings parse (checked before submitting; "
                          f"{len(broken)} do not, e.g. point {index}, {describe_point(points[index])}: {error})",
                          str(plan_path))
    if not SWEEP_SCRIPT.is_file():
        raise ConfigError("slurm", f"{SWEEP_SCRIPT} in the working folder: submit from the repository root",
                          str(Path.cwd()))
    array = f"0-{len(points) - 1}" + (f"%{options.jobs}" if options.jobs else "")
    command = ["sbatch", f"--array={array}"]
    ranks = max(options.gpus_per_run, 1)
    if options.gpus_per_run:
        command += [f"--ntasks-per-node={ranks}", f"--gpus-per-node={options.gpus_per_run}"]
    if options.threads_per_run:
        command.append(f"--cpus-per-task={max(1, options.threads_per_run // ranks)}")
    command += [*options.sbatch_options, str(SWEEP_SCRIPT), str(plan_path), "--runs_root", str(options.runs_root)]
    print(f"{len(points)} grid points as one array job: {shlex.join(command)}", flush=True)
    if options.dry_run:
        return
    if shutil.which("sbatch") is None:
        raise ConfigError("slurm", "SLURM's sbatch on PATH (run on the cluster's login node)", "no sbatch")
    Path("logs").mkdir(exist_ok=True)  # sbatch does not create the folder of its --output
    completed = subprocess.run(command, capture_output=True, text=True)
    print(completed.stdout, end="", flush=True)  # "Submitted batch job <id>"
    if completed.returncode != 0:
        print(f"error: sbatch exited {completed.returncode}: {completed.stderr.strip()}", file=sys.stderr)
        raise SystemExit(1)


# --- on this machine ----------------------------------------------------------------------------------

@dataclass
class Resources:
    """What each local run gets."""

    accelerator: str
    devices: int
    threads: int
    """OMP_NUM_THREADS of each rank."""
    gpu_slots: Optional[list[list[str]]]
    """Per slot (one run at a time each), the GPUs of CUDA_VISIBLE_DEVICES; None on the CPU."""

    def describe(self) -> str:
        if self.gpu_slots is None:
            return f"on the CPU, {self.threads} thread(s) each"
        return f"on {self.devices} GPU(s) each ({self.threads} CPU thread(s) per rank)"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else every one torch sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    import torch

    return [str(gpu) for gpu in range(torch.cuda.device_count())]


def plan_resources(jobs: int, gpus_per_run: int, threads_per_run: Optional[int]) -> Resources:
    """Share the machine between `jobs` runs without oversubscribing it; refuse what it cannot give."""
    cores = available_cores()
    if gpus_per_run == 0:
        if jobs > cores:
            raise ConfigError("jobs", f"at most the {cores} CPU cores of this machine for runs on the CPU "
                              "(or --gpus_per_run)", jobs)
        threads = threads_per_run or max(1, cores // jobs)
        if threads * jobs > cores:
            raise ConfigError("threads_per_run", f"at most {cores // jobs} with {jobs} runs at a time on {cores} "
                              "cores", threads)
        return Resources(accelerator="cpu", devices=1, threads=threads, gpu_slots=None)
    gpus = visible_gpus()
    if gpus_per_run > len(gpus):
        raise ConfigError("gpus_per_run", f"at most the {len(gpus)} GPU(s) visible here", gpus_per_run)
    if jobs * gpus_per_run > len(gpus):
        raise ConfigError("jobs", f"at most {len(gpus) // gpus_per_run} runs of {gpus_per_run} GPU(s) at a time "
                          f"({len(gpus)} GPU(s) visible: {','.join(gpus)})", jobs)
    threads = max(1, (threads_per_run or max(1, cores // jobs)) // gpus_per_run)
    slots = [gpus[slot * gpus_per_run:(slot + 1) * gpus_per_run] for slot in range(jobs)]
    return Resources(accelerator="gpu", devices=gpus_per_run, threads=threads, gpu_slots=slots)


def fit_command(point: GridPoint, resources: Resources) -> list[str]:
    """The run's `fit` process; the devices come last, so they override whatever the plan sets (devices
    may change between attempts of a run: a grid started on a laptop continues on GPUs)."""
    return [sys.executable, "-m", "fl_lightning", *point.fit_arguments(),
            "--fabric.accelerator", resources.accelerator, "--fabric.devices", str(resources.devices),
            "--fabric.num_nodes", "1", "--logger.progress_bar", "false"]


def run_environment(resources: Resources, slot: int) -> dict[str, str]:
    """A local run is a plain process of this machine: no SLURM or launcher variables (the sweep may
    itself run inside an allocation), its threads, its GPUs."""
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith("SLURM_") and name not in LAUNCHER_VARIABLES}
    environment.update(OMP_NUM_THREADS=str(resources.threads), MKL_NUM_THREADS=str(resources.threads),
                       PYTHONUNBUFFERED="1")
    if resources.gpu_slots is not None:
        environment["CUDA_VISIBLE_DEVICES"] = ",".join(resources.gpu_slots[slot])
    return environment


@dataclass
class Running:
    point: GridPoint
    process: subprocess.Popen
    slot: int
    started: float
    log_offset: int
    signalled: bool = False


class StopRequest:
    """SIGINT / SIGTERM to the sweep: recorded here, acted on by the loop."""

    def __init__(self):
        self.signals: list[signal.Signals] = []

    def __call__(self, signum, frame) -> None:
        self.signals.append(signal.Signals(signum))

    @contextlib.contextmanager
    def installed(self):
        signums = (signal.SIGINT, signal.SIGTERM)
        previous = {signum: signal.signal(signum, self) for signum in signums}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def run_locally(points: list[GridPoint], options: SweepOptions, on_terminal: bool) -> int:
    """Run the unfinished points, `jobs` at a time; the sweep's exit status."""
    jobs = options.jobs or 1
    resources = plan_resources(jobs, options.gpus_per_run, options.threads_per_run)
    states = point_states(points)
    skipped = [point for point in points if states[point.index].finished]
    to_run = [point for point in points if not states[point.index].finished]
    for point in skipped:
        print(f"[{point.index}] skipped, finished (round {states[point.index].round}): {describe_point(point)} "
              f"in {point.out_dir}", flush=True)
    print(f"{len(points)} runs: {len(skipped)} finished already, {len(to_run)} to run, up to {jobs} at a time "
          f"{resources.describe()}", flush=True)
    if resources.gpu_slots is None and options.gpus_per_run == 0 and to_run:
        _note_unused_gpus()
    if options.dry_run:
        for slot, point in enumerate(to_run):
            environment = run_environment(resources, slot % jobs)
            shown = [f"{name}={environment[name]}" for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
                     if name in environment]
            print(f"[{point.index}] {' '.join(shown)} {shlex.join(fit_command(point, resources))}")
        return 0
    return _Loop(to_run, states, len(skipped), resources, jobs, on_terminal).run()


def _note_unused_gpus() -> None:
    import torch

    if torch.cuda.is_available():
        print(f"note: {torch.cuda.device_count()} GPU(s) visible, but runs use the CPU (--gpus_per_run 0)",
              flush=True)


class _Loop:
    def __init__(self, points: list[GridPoint], states: dict[int, RunState], skipped: int, resources: Resources,
                 jobs: int, on_terminal: bool):
        self.pending = list(points)
        self.rounds = {index: state.rounds for index, state in states.items()}
        self.skipped = skipped
        self.resources = resources
        self.free_slots = list(range(jobs))
        self.on_terminal = on_terminal
        self.running: list[Running] = []
        self.finished: list[GridPoint] = []
        self.failed: list[GridPoint] = []
        self.stopped: list[GridPoint] = []
        self.stop = StopRequest()
        self.killed = False

    def run(self) -> int:
        with self.stop.installed():
            while self.running or (self.pending and not self.stop.signals):
                self._act_on_signals()
                while self.pending and self.free_slots and not self.stop.signals:
                    self._start(self.pending.pop(0), self.free_slots.pop(0))
                self._collect()
                if self.running:
                    time.sleep(POLL_SECONDS)
            self._act_on_signals()
        return self._summary()

    def _start(self, point: GridPoint, slot: int) -> None:
        command = fit_command(point, self.resources)
        environment = run_environment(self.resources, slot)
        point.out_dir.mkdir(parents=True, exist_ok=True)
        log = point.out_dir / LOG_FILE
        header = f"=== {datetime.now().isoformat(timespec='seconds')} fl-lightning sweep: {shlex.join(command)}\n"
        with open(log, "ab") as handle:
            handle.write(header.encode())
            offset = handle.tell()
            output = {} if self.on_terminal else {"stdout": handle, "stderr": subprocess.STDOUT}
            # A session of its own: Ctrl-C in the terminal reaches the sweep only, which asks each run
            # to stop at a round boundary instead of letting it die mid-round.
            process = subprocess.Popen(command, env=environment, stdin=subprocess.DEVNULL, start_new_session=True,
                                       **output)
        self.running.append(Running(point, process, slot, time.monotonic(), offset))
        where = "" if self.on_terminal else f" (log {log})"
        print(f"[{point.index}] started: {describe_point(point)} in {point.out_dir}{where}", flush=True)

    def _act_on_signals(self) -> None:
        if not self.stop.signals:
            return
        if len(self.stop.signals) >= 2 and not self.killed:
            self.killed = True
            print(f"{self.stop.signals[-1].name} again: killing {len(self.running)} run(s); they resume from "
                  "their last checkpoint", file=sys.stderr, flush=True)
            for run in self.running:
                _send(run.process, signal.SIGKILL)
        unsignalled = [run for run in self.running if not run.signalled]
        if unsignalled:
            print(f"{self.stop.signals[0].name}: asking {len(unsignalled)} run(s) to checkpoint and stop at the end "
                  f"of their round (SIGTERM); {len(self.pending)} not started. Signal again to kill them at once.",
                  file=sys.stderr, flush=True)
        for run in unsignalled:
            run.signalled = True
            _send(run.process, signal.SIGTERM)

    def _collect(self) -> None:
        for run in list(self.running):
            status = run.process.poll()
            if status is None:
                continue
            self.running.remove(run)
            self.free_slots.append(run.slot)
            self._report(run, status)

    def _report(self, run: Running, status: int) -> None:
        point, seconds = run.point, time.monotonic() - run.started
        if status == 0:
            state = run_state(point.out_dir, self.rounds[point.index])
            if run.signalled and not state.finished:
                self.stopped.append(point)
                print(f"[{point.index}] stopped at round {state.round}: {describe_point(point)} in {point.out_dir} "
                      "(checkpoint saved; the same command continues it)", flush=True)
            else:
                self.finished.append(point)
                print(f"[{point.index}] finished at round {state.round}: {describe_point(point)} in {seconds:.1f} s",
                      flush=True)
            return
        if run.signalled:
            self.stopped.append(point)
            print(f"[{point.index}] stopped ({_exit_status(status)}): {describe_point(point)} in {point.out_dir}; "
                  "the same command continues it from its last checkpoint", flush=True)
            return
        self.failed.append(point)
        lines = [] if self.on_terminal else _log_tail(point.out_dir / LOG_FILE, run.log_offset)
        report = [f"[{point.index}] FAILED with {_exit_status(status)}: {describe_point(point)} in {point.out_dir}"]
        if lines:
            report.append(f"    last lines of {point.out_dir / LOG_FILE}:")
            report += [f"    | {line}" for line in lines]
        print("\n".join(report), file=sys.stderr, flush=True)

    def _summary(self) -> int:
        summary = f"{len(self.finished)} finished, {len(self.failed)} failed, {self.skipped} skipped"
        if self.stop.signals:
            summary += f", {len(self.stopped)} stopped, {len(self.pending)} not started"
        print(summary, flush=True)
        if self.failed:
            print("failed: " + ", ".join(f"[{p.index}] {p.out_dir / LOG_FILE}" for p in self.failed), file=sys.stderr,
                  flush=True)
        if self.stop.signals:
            print(f"interrupted by {self.stop.signals[0].name}: run the same command again to continue",
                  file=sys.stderr, flush=True)
            return 128 + self.stop.signals[0]
        return 1 if self.failed else 0


def _send(process: subprocess.Popen, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signum)


def _exit_status(status: int) -> str:
    return f"signal {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"


def _log_tail(path: Path, offset: int) -> list[str]:
    """The last lines this attempt wrote to the log."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-TAIL_LINES:]
