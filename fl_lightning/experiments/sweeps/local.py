"""A sweep's runs on this machine: `--jobs N` at a time, each a subprocess `python -m fl_lightning fit ...`
writing to <run folder>/sweep.log, with its share of the machine: CPUs of its own (its affinity) on the CPU,
or CUDA_VISIBLE_DEVICES naming its own GPUs.

- A run is taken by one sweep: the sweep holds <run folder>/.sweep.lock while the run trains (and
  writes its sweep.log). A run whose folder another sweep, or a `fit` started by hand, holds is
  "running elsewhere": skipped, not a failure. So several sweeps of one plan, on machines or
  allocations that share the run folders, split the grid between them; a run that another sweep
  finished meanwhile is skipped as finished.
- SIGINT (Ctrl-C), SIGTERM or SIGHUP (the terminal closed) asks the running runs to checkpoint and
  stop at the end of their round (they get SIGTERM), waits for them and exits 130 / 143 / 129; a
  second one kills them at once. Runs are in sessions of their own, so the terminal's signals reach
  the sweep only; after SIGHUP the sweep writes nothing more to the terminal that is gone. No run is
  left training without its sweep.
- A failing run is reported and the others go on; the sweep then exits 1.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Optional, Sequence

from fl_lightning.experiments.plans.plan import GridPoint
from fl_lightning.experiments.plans.resolve import ResolvedPoint, describe_point
from fl_lightning.experiments.runs import (
    LOG_FILE,
    POLL_SECONDS,
    SWEEP_LOCK_FILE,
    RunFolder,
    RunState,
    fit_running_in,
)
from fl_lightning.experiments.sweeps.machine import Resources, SweepOptions, plan_resources
from fl_lightning.experiments.sweeps.progress import ProgressLines, RunLeft
from fl_lightning.run_dir import FolderInUse, RunDirLock

TAIL_LINES = 15
"""Lines of a failed run's log shown in its report."""
# Set by a launcher for the processes it starts; a local run must not inherit them (it would not be
# rank 0, or would wait for ranks of another job).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)



def fit_command(point: GridPoint, resources: Resources) -> list[str]:
    """The run's `fit` process; the devices come last, so they override whatever the plan sets (devices
    may change between attempts of a run: a grid started on a laptop continues on GPUs)."""
    return [sys.executable, "-m", "fl_lightning", *point.fit_arguments(),
            "--fabric.accelerator", resources.accelerator, "--fabric.devices", str(resources.devices),
            "--fabric.num_nodes", "1", "--logger.progress_bar", "false"]


def run_environment(resources: Resources, slot: int) -> dict[str, str]:
    """A local run is a plain process of this machine: no SLURM or launcher variables (the sweep may
    itself run inside an allocation), its GPUs, and its threads unless its CPUs are its own (then it
    chooses them, `Resources.cpu_slots`)."""
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith("SLURM_") and name not in LAUNCHER_VARIABLES}
    environment["PYTHONUNBUFFERED"] = "1"
    if resources.cpu_slots is None:
        environment.update(OMP_NUM_THREADS=str(resources.threads), MKL_NUM_THREADS=str(resources.threads))
    if resources.gpu_slots is not None:
        environment["CUDA_VISIBLE_DEVICES"] = ",".join(resources.gpu_slots[slot])
    return environment


def start_run_process(command: list[str], environment: dict[str, str], log: Optional[IO[bytes]],
                      cpus: Optional[list[int]] = None) -> subprocess.Popen:
    """A run's process, its output to `log` (None: the sweep's terminal), bound to `cpus` if given. In a
    session of its own: Ctrl-C in the terminal reaches the sweep only, which asks each run to stop at a
    round boundary instead of letting it die mid-round."""
    output = {} if log is None else {"stdout": log, "stderr": subprocess.STDOUT}
    bind = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    return subprocess.Popen(command, env=environment, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=bind, **output)


@dataclass
class Running:
    point: GridPoint
    process: subprocess.Popen
    slot: int
    started: float
    log_offset: int
    lock: RunDirLock
    signalled: bool = False


class StopRequest:
    """SIGINT / SIGTERM / SIGHUP to the sweep: recorded here, acted on by the loop."""

    def __init__(self):
        self.signals: list[signal.Signals] = []

    def __call__(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            _leave_the_terminal()
        self.signals.append(signal.Signals(signum))

    @contextlib.contextmanager
    def installed(self):
        previous = {signum: signal.signal(signum, self) for signum in STOP_SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _leave_the_terminal() -> None:
    """The terminal is gone: writing to it would fail (EIO) and end the sweep with its runs still
    training, so what the sweep still has to say goes nowhere (each run's log is in its folder)."""
    devnull = open(os.devnull, "w")
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        with contextlib.suppress(OSError, ValueError):
            if stream.isatty():
                setattr(sys, name, devnull)


def hold_run_folder(out_dir: Path) -> RunDirLock:
    """The sweep's lock of a run folder, held; FolderInUse when another sweep holds it or a `fit`
    runs in it."""
    lock = RunDirLock(out_dir, SWEEP_LOCK_FILE)
    lock.acquire()
    # A `fit` started by hand holds the run's own lock.
    holder = fit_running_in(out_dir)
    if holder is not None:
        lock.release()
        raise FolderInUse(holder, out_dir)
    return lock


@dataclass
class Outcome:
    """What became of a local sweep's runs."""

    status: int
    """The sweep's exit status."""
    failed: list[GridPoint]
    elsewhere: list[GridPoint]
    """Skipped: another process held their folders."""
    interrupted: bool = False


def run_locally(resolved: list[ResolvedPoint], states: dict[int, RunState], options: SweepOptions,
                on_terminal: bool, then: Sequence[ResolvedPoint] = ()) -> Outcome:
    """Run the unfinished points, `jobs` at a time (`then`: the runs of the sweep's next stage, which its
    progress lines count in the time left)."""
    jobs = options.jobs or 1
    resources = plan_resources(jobs, options.gpus_per_run, options.threads_per_run)
    points = [entry.point for entry in resolved]
    skipped = [point for point in points if states[point.index].finished]
    to_run = [point for point in points if not states[point.index].finished]
    for point in skipped:
        print(f"[{point.index}] skipped, {_finished(states[point.index])}: {describe_point(point)} in {point.out_dir}",
              flush=True)
    print(f"{len(points)} runs: {len(skipped)} finished already, {len(to_run)} to run, up to {jobs} at a time "
          f"{resources.describe()}", flush=True)
    if resources.gpu_slots is None and options.gpus_per_run == 0 and to_run:
        note_unused_gpus()
    if options.dry_run:
        for slot, point in enumerate(to_run):
            environment = run_environment(resources, slot % jobs)
            if resources.cpu_slots is None:
                shown = [f"{name}={environment[name]}" for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
                         if name in environment]
            else:
                shown = [f"cpus={','.join(map(str, resources.cpu_slots[slot % jobs]))}"]
            print(f"[{point.index}] {' '.join(shown)} {shlex.join(fit_command(point, resources))}")
        return Outcome(0, [], [])
    rounds = {entry.point.index: entry.rounds for entry in resolved}
    # A run in the foreground shows its own rounds.
    # A point whose settings are refused has no rounds to count (the grid's check names it).
    later = [RunLeft(entry.point.method, entry.rounds, None, starting=True) for entry in then
             if entry.rounds is not None]
    progress = None if on_terminal else ProgressLines(rounds, {i: state.round or 0 for i, state in states.items()},
                                                      jobs, total=len(points), then=later)
    loop = _Loop(to_run, rounds, len(skipped), resources, jobs, on_terminal, progress)
    return Outcome(loop.run(), loop.failed, loop.elsewhere, interrupted=bool(loop.stop.signals))


def _finished(state: RunState) -> str:
    return f"finished (round {state.round}" + (", stopped early)" if state.stopped_early else ")")


def note_unused_gpus() -> None:
    import torch

    if torch.cuda.is_available():
        print(f"note: {torch.cuda.device_count()} GPU(s) visible, but runs use the CPU (--gpus_per_run 0)",
              flush=True)


class _Loop:
    def __init__(self, points: list[GridPoint], rounds: dict[int, int], skipped: int, resources: Resources,
                 jobs: int, on_terminal: bool, progress: Optional[ProgressLines]):
        self.pending = list(points)
        self.progress = progress
        self.rounds = rounds
        self.skipped = skipped
        self.elsewhere: list[GridPoint] = []
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
                    self._take(self.pending.pop(0))
                self._collect()
                self._show_progress()
                if self.running:
                    time.sleep(POLL_SECONDS)
            self._act_on_signals()
        return self._summary()

    def _take(self, point: GridPoint) -> None:
        """Start the point's run unless another process holds its folder or has finished it meanwhile."""
        point.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            lock = hold_run_folder(point.out_dir)
        except FolderInUse as busy:
            self.elsewhere.append(point)
            print(f"[{point.index}] skipped, running elsewhere (held by {busy.holder}): {describe_point(point)} in "
                  f"{point.out_dir}", flush=True)
            return
        state = RunFolder(point.out_dir).state(self.rounds[point.index])
        if state.finished:
            lock.release()
            self.skipped += 1
            print(f"[{point.index}] skipped, {_finished(state)} elsewhere: {describe_point(point)} in {point.out_dir}",
                  flush=True)
            return
        self._start(point, self.free_slots.pop(0), lock)

    def _start(self, point: GridPoint, slot: int, lock: RunDirLock) -> None:
        command = fit_command(point, self.resources)
        environment = run_environment(self.resources, slot)
        log = point.out_dir / LOG_FILE
        header = f"=== {datetime.now().isoformat(timespec='seconds')} fl-lightning sweep: {shlex.join(command)}\n"
        with open(log, "ab") as handle:
            handle.write(header.encode())
            offset = handle.tell()
            process = start_run_process(command, environment, None if self.on_terminal else handle,
                                        None if self.resources.cpu_slots is None else self.resources.cpu_slots[slot])
        self.running.append(Running(point, process, slot, time.monotonic(), offset, lock))
        where = "" if self.on_terminal else f" (log {log})"
        print(f"[{point.index}] started: {describe_point(point)} in {point.out_dir}{where}", flush=True)

    def _show_progress(self) -> None:
        if self.progress is None:
            return
        line = self.progress.line([run.point for run in self.running], self.pending,
                                  len(self.finished) + self.skipped, len(self.failed))
        if line is not None:
            print(line, flush=True)

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
            run.lock.release()
            self.free_slots.append(run.slot)
            self._report(run, status)

    def _report(self, run: Running, status: int) -> None:
        point, seconds = run.point, time.monotonic() - run.started
        if status == 0:
            state = RunFolder(point.out_dir).state(self.rounds[point.index])
            if run.signalled and not state.finished:
                self.stopped.append(point)
                print(f"[{point.index}] stopped at round {state.round}: {describe_point(point)} in {point.out_dir} "
                      "(checkpoint saved; the same command continues it)", flush=True)
            else:
                self.finished.append(point)
                print(f"[{point.index}] finished at round {state.round}: {describe_point(point)} in {seconds:.1f} s",
                      flush=True)
                if self.progress is not None:
                    self.progress.run_ended(point, seconds)
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
        if self.elsewhere:
            summary += f", {len(self.elsewhere)} running elsewhere"
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
