"""SLURM and preemption: signal handling, requeue, and checks against the allocation.

Fabric has no requeue logic (only the Trainer does), and the default action of SIGUSR1 kills the
process. So the run installs its own handler: it only records the request; the round loop turns
it into a checkpoint at the next round boundary, agreed on by every rank, after which rank 0
requeues the job (or not, see requeue_after_stop) and all ranks exit cleanly.

The protocol: the requeue signal (`checkpoint.requeue_signal`, SIGUSR1 in the batch scripts: what
`sbatch --signal` sends ahead of the time limit, and `scancel -s USR1` by hand) means "checkpoint
and come back"; SIGTERM is sent by `scancel` (stop for good), by a preemption's grace time and by
Slurm's own requeue. Whatever the signal, the job is requeued only while Slurm still reports it
RUNNING: `scancel`, the time limit and Slurm's own requeue move it out of RUNNING (CANCELLED,
COMPLETING, TIMEOUT, PENDING, ...) before they signal its steps, while a preemption's grace time
leaves it RUNNING. Slurm 22.05 reports a cancelled job and one it has requeued itself (a preemption
without grace time, a hand `scontrol requeue`) alike, COMPLETING while the steps are killed; the
requeue alone counts in the job's `Restarts`, which then exceeds the SLURM_RESTART_COUNT this
attempt started with.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Union

from fl_lightning.config import FabricArgs
from fl_lightning.cpu import available_cores
from fl_lightning.errors import ConfigError
from fl_lightning.run_dir import is_launching_process

# Fabric's SLURMEnvironment.detect ignores allocations with these job names, so that processes can
# be started by hand inside `salloc` or `srun --pty bash`; the allocation check follows it.
INTERACTIVE_JOB_NAMES = ("bash", "interactive")
# These cannot be caught, so they could never ask for a checkpoint.
UNCATCHABLE_SIGNALS = ("SIGKILL", "SIGSTOP")


class StopSignals:
    """Records that the job was asked to stop: by `signal_name` (what `sbatch --signal` sends
    ahead of the time limit) or by SIGTERM (what SLURM sends on scancel, preemption and timeout).

    The command line installs it as early as possible (`hold_until_exit`, before its heavy imports,
    since Slurm's early signal may arrive during start-up) and never gives the signals back: once
    its command is done they are ignored until the process exits (`ignore_until_exit`). Python
    puts back the default action of every signal it handles while the interpreter shuts down, and
    that action kills: a time limit's signal just after the last round, the SIGTERM of the job's
    own requeue, or a second signal, would otherwise end a finished run with 138 or 143.
    `fit` called from Python installs and uninstalls it around the run, leaving the caller's
    handlers as it found them.
    """

    def __init__(self):
        self.received: set[signal.Signals] = set()
        self.listener: Optional[Callable[[signal.Signals], None]] = None
        """Told of each signal as it arrives (the running loop's stop request)."""
        self._previous_handlers: dict[signal.Signals, object] = {}
        self._held_until_exit = False

    @property
    def requested(self) -> bool:
        return bool(self.received)

    def install(self, signal_name: Optional[str] = "SIGUSR1") -> list[signal.Signals]:
        """Start recording SIGTERM and `signal_name`; returns the signals this call began to handle
        (none when already recording them, or off the main thread, where Python allows no handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return []
        requeue_signal = signal.Signals[signal_name] if signal_name else None
        added = sorted({signal.SIGTERM, requeue_signal} - {None} - set(self._previous_handlers))
        for signum in added:
            self._previous_handlers[signum] = signal.signal(signum, self._record)
        return added

    def _record(self, signum: int, frame) -> None:
        # Only flags: the loop may be inside a collective, and saving from here would race the ranks.
        self.received.add(signal.Signals(signum))
        if self.listener is not None:
            self.listener(signal.Signals(signum))

    def uninstall(self, signums: list[signal.Signals]) -> None:
        """Put back the handlers that were there before `install` returned `signums` (for `fit`
        called from Python, which must leave the caller's handlers as it found them); in the
        command line's process, ignore those signals instead, until it exits."""
        for signum in signums:
            previous = self._previous_handlers.pop(signum)
            signal.signal(signum, signal.SIG_IGN if self._held_until_exit else previous)
        if not self._previous_handlers:
            self.received.clear()

    def hold_until_exit(self, signal_name: Optional[str] = "SIGUSR1") -> None:
        """Start recording SIGTERM and `signal_name` for a process that ends with its command (the
        command line's): a signal the run installs later is ignored, not given back, when it ends."""
        self._held_until_exit = True
        self.install(signal_name)

    def ignore_until_exit(self) -> None:
        """Ignore the signals recorded so far from now until the process exits (its command is done;
        SIG_IGN, unlike a Python handler, lasts through the interpreter's shutdown)."""
        for signum in self._previous_handlers:
            signal.signal(signum, signal.SIG_IGN)


STOP_SIGNALS = StopSignals()


class RequeueFailed(RuntimeError):
    """The checkpoint is saved but the job could not be put back in the queue."""


# States of a job that Slurm has put back in the queue itself (a preemption without grace time).
QUEUED_STATES = ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD")
# What `scontrol requeue` answers for a job Slurm has already requeued.
ALREADY_QUEUED_ERROR = "pending execution"


@dataclass(frozen=True)
class SlurmJob:
    """What `scontrol show job` says of a job."""

    state: Optional[str]
    """JobState (RUNNING, COMPLETING, ...); None where it could not be read (`unread` says why)."""
    restarts: Optional[int]
    """Restarts: how often the job has been requeued; None where scontrol gives none."""
    unread: str = ""

    def requeued_since(self, attempt_restarts: int) -> bool:
        """Whether Slurm has requeued the job since the attempt that started as restart
        `attempt_restarts` (SLURM_RESTART_COUNT): it is back in the queue, whatever its state says."""
        return self.state in QUEUED_STATES or (self.restarts is not None and self.restarts > attempt_restarts)


def requeue_after_stop(signal_name: Optional[str], received: set[signal.Signals]) -> None:
    """Put this SLURM job back in the queue after a stop (rank 0 calls it once the checkpoint and
    the logs are closed: `scontrol requeue` makes Slurm kill the job's steps at once), if it is
    still RUNNING (the module's protocol). Outside SLURM nothing happens: the run has ended cleanly
    and the same command resumes it.

    A cancelled or ending job stays as it is; a preempted job that exited 0 in its grace time
    without a requeue would be recorded COMPLETED mid-run and never resumed; a job Slurm has
    requeued itself is already where the requeue would put it, and advice to submit it again would
    start a second job racing it for the run.
    """
    job_id = slurm_job_id()
    if job_id is None:
        return
    requeue_signal = signal.Signals[signal_name] if signal_name else None
    job = slurm_job(job_id)
    if job.state is None and requeue_signal not in received:
        raise RequeueFailed(f"checkpoint saved, but the state of SLURM job {job_id} could not be read ({job.unread}), "
                            "and SIGTERM alone cannot tell a cancellation from a preemption: not requeued; "
                            "resubmit the job to resume unless it was cancelled")
    attempt_restarts = slurm_restart_count()
    if job.requeued_since(attempt_restarts):
        restarts = "" if job.restarts is None else f", Restarts={job.restarts} where this attempt started at " \
                                                   f"{attempt_restarts}"
        print(f"SLURM job {job_id} is already back in the queue ({job.state}{restarts}): checkpoint saved, "
              "the requeued job resumes from it", flush=True)
        return
    if job.state is not None and job.state != "RUNNING":
        print(f"SLURM job {job_id} is {job.state} (cancelled or ending): checkpoint saved, not requeueing; the same "
              "command submitted again resumes the run", flush=True)
        return
    command = ["scontrol", "requeue", job_id]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RequeueFailed(f"checkpoint saved, but {' '.join(command)} failed: {err}; "
                            "resubmit the job to resume") from err
    answer = f"{completed.stderr.strip()} {completed.stdout.strip()}".strip()
    if completed.returncode != 0 and ALREADY_QUEUED_ERROR in answer.lower():
        # Slurm requeued the job between the state read above and this call.
        print(f"SLURM job {job_id} is already back in the queue ({answer}): checkpoint saved", flush=True)
        return
    if completed.returncode != 0:
        raise RequeueFailed(f"checkpoint saved, but {' '.join(command)} exited {completed.returncode}: "
                            f"{answer}; resubmit the job to resume")
    print(f"requeued SLURM job {job_id}: {' '.join(command)}", flush=True)


def slurm_job(job_id: str) -> SlurmJob:
    """`job_id` as `scontrol show job` reports it."""
    command = ["scontrol", "show", "job", "--oneliner", job_id]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return SlurmJob(None, None, f"{' '.join(command)} failed: {err}")
    state, restarts = re.search(r"\bJobState=(\S+)", completed.stdout), re.search(r"\bRestarts=(\d+)", completed.stdout)
    if state is None:
        return SlurmJob(None, None, f"{' '.join(command)} exited {completed.returncode}: "
                                    f"{completed.stderr.strip() or 'no JobState'}")
    return SlurmJob(state.group(1), int(restarts.group(1)) if restarts else None)


def slurm_restart_count() -> int:
    """How often the job had been requeued when this attempt started (Slurm leaves the variable unset
    on the first)."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def slurm_job_id() -> Optional[str]:
    """The id `scontrol requeue` takes: `<array job>_<task>` for an array task (so that only this
    task restarts, not the whole array), else the job id; None outside SLURM."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        return None
    array_job_id = os.environ.get("SLURM_ARRAY_JOB_ID")
    array_task_id = os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job_id and array_task_id:
        return f"{array_job_id}_{array_task_id}"
    return job_id


def slurm_tasks_per_node() -> Optional[int]:
    """The tasks per node of the SLURM allocation this process runs in; None outside SLURM and in
    an interactive allocation, where ranks are started by hand (as Fabric's detection assumes)."""
    if "SLURM_NTASKS" not in os.environ or os.environ.get("SLURM_JOB_NAME") in INTERACTIVE_JOB_NAMES:
        return None
    # SLURM_NTASKS_PER_NODE is only set when the job asked for --ntasks-per-node.
    tasks_per_node = os.environ.get("SLURM_NTASKS_PER_NODE")
    return int(tasks_per_node) if tasks_per_node else int(os.environ["SLURM_NTASKS"]) // slurm_nodes()


def slurm_nodes() -> int:
    return int(os.environ.get("SLURM_NNODES", "1"))


def check_slurm_allocation(fabric_args: FabricArgs) -> None:
    """Under SLURM every rank is a task started by srun, so Fabric's ranks per node and nodes must
    be the allocation's (`devices: auto` is the allocation's tasks per node). Fabric checks this
    too, but only after the data is loaded and with a message that names no config field."""
    tasks = slurm_tasks_per_node()
    if tasks is None:
        # Without SLURM or a launcher's rendezvous variables, the other nodes never join and the
        # process group would wait out its whole timeout. MASTER_PORT too: without it Lightning
        # picks a free port on each node, so the nodes would wait on different ports. torchrun
        # names the node's rank GROUP_RANK.
        rendezvous = {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys() and not \
            {"NODE_RANK", "GROUP_RANK"}.isdisjoint(os.environ.keys())
        if fabric_args.num_nodes > 1 and not rendezvous:
            raise ConfigError("fabric.num_nodes", "1 outside SLURM (or every node started with MASTER_ADDR, "
                              "MASTER_PORT and NODE_RANK set)", fabric_args.num_nodes)
        return
    nodes = slurm_nodes()
    if fabric_args.devices != "auto" and fabric_args.devices != tasks:
        raise ConfigError("fabric.devices", f"the tasks per node of the SLURM allocation ({tasks})",
                          fabric_args.devices)
    if fabric_args.num_nodes != nodes:
        raise ConfigError("fabric.num_nodes", f"the nodes of the SLURM allocation ({nodes})", fabric_args.num_nodes)


@dataclass(frozen=True)
class Ranks:
    """What `fabric.devices` comes to in this process."""

    per_node: Union[int, Literal["auto"]]
    """The devices Fabric is given: a number of ranks, or `auto` (Fabric's: every visible GPU)."""


def resolve_ranks(devices: Union[int, Literal["auto"]], *, on_cpu: bool, cores: int, slurm_tasks: Optional[int] = None,
                  started_ranks: Optional[int] = None, interactive: bool = False) -> Ranks:
    """The rule of `fabric.devices` (FabricArgs.devices), from what this process sees.

    A number is kept. `auto`: under SLURM (`slurm_tasks`) the allocation's tasks per node; on a GPU
    Fabric's `auto`; in an interactive session 1 rank; else on the CPU one rank per core (`cores`).
    A rank started by a launcher (`started_ranks`: the ranks per node its launcher started) takes
    that number rather than counting cores again, so every rank agrees. (Each CPU rank's threads:
    fl_lightning.cpu.)
    """
    if devices != "auto":
        return Ranks(int(devices))
    if slurm_tasks is not None:
        return Ranks(slurm_tasks)
    if not on_cpu:
        return Ranks("auto")
    if interactive:
        return Ranks(1)
    return Ranks(started_ranks if started_ranks is not None else max(1, cores))


def started_ranks_per_node(num_nodes: int) -> Optional[int]:
    """The ranks per node that the launcher of this process started, or None in the process that
    launches them. torchrun sets LOCAL_WORLD_SIZE in every rank; Fabric, which re-runs the command
    for ranks 1.., sets WORLD_SIZE (ranks in all) and a LOCAL_RANK or NODE_RANK other than 0."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if is_launching_process() or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["WORLD_SIZE"]) // num_nodes


def ranks_of(fabric_args: FabricArgs) -> Ranks:
    """What `fabric.devices` comes to in this process (resolve_ranks), the same in every rank."""
    from lightning.fabric.utilities.imports import _IS_INTERACTIVE

    return resolve_ranks(fabric_args.devices, on_cpu=fabric_args.runs_on_cpu(), cores=available_cores(),
                         slurm_tasks=slurm_tasks_per_node(),
                         started_ranks=started_ranks_per_node(fabric_args.num_nodes), interactive=_IS_INTERACTIVE)


def check_signal_name(signal_name: Optional[str]) -> None:
    if signal_name is None:
        return
    if signal_name not in signal.Signals.__members__ or signal_name in UNCATCHABLE_SIGNALS:
        raise ConfigError("checkpoint.requeue_signal", "a signal name such as SIGUSR1 (or null)", signal_name)
