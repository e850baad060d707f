"""SLURM and preemption: signal handling, requeue, and checks against the allocation.

Fabric has no requeue logic (only the Trainer does), and the default action of SIGUSR1 kills the
process. So the run installs its own handler: it only records the request; the round loop turns
it into a checkpoint at the next round boundary, agreed on by every rank, after which rank 0
requeues the job and all ranks exit cleanly.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from typing import Callable, Optional

from fl_lightning.config import ConfigError, FabricArgs

# Fabric's SLURMEnvironment.detect ignores allocations with these job names, so that processes can
# be started by hand inside `salloc` or `srun --pty bash`; the allocation check follows it.
INTERACTIVE_JOB_NAMES = ("bash", "interactive")
# These cannot be caught, so they could never ask for a checkpoint.
UNCATCHABLE_SIGNALS = ("SIGKILL", "SIGSTOP")


class StopSignals:
    """Records that the job was asked to stop: by `signal_name` (what `sbatch --signal` sends
    ahead of the time limit) or by SIGTERM (what SLURM sends on scancel, preemption and timeout).

    Installed as early as possible (the command line does it before its heavy imports, since
    Slurm's early signal may arrive during start-up) and kept until the process exits: a signal
    after the last round or during teardown is recorded and ignored, never fatal to a finished run.
    """

    def __init__(self):
        self.received: set[signal.Signals] = set()
        self.listener: Optional[Callable[[signal.Signals], None]] = None
        """Told of each signal as it arrives (the running loop's stop request)."""
        self._previous_handlers: dict[signal.Signals, object] = {}

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
        called from Python, which must leave the caller's handlers as it found them)."""
        for signum in signums:
            signal.signal(signum, self._previous_handlers.pop(signum))
        if not self._previous_handlers:
            self.received.clear()


STOP_SIGNALS = StopSignals()


class RequeueFailed(RuntimeError):
    """The checkpoint is saved but the job could not be put back in the queue."""


def requeue_after_stop(signal_name: Optional[str], received: set[signal.Signals]) -> None:
    """Put this SLURM job back in the queue after a stop (rank 0 calls it once the checkpoint and
    the logs are closed: `scontrol requeue` makes Slurm kill the job's steps at once). Outside
    SLURM nothing happens: the run has ended cleanly and the same command resumes it.

    SIGTERM is sent both by `scancel` (which must not bring the job back) and by a preemption or
    the time limit (which must): the job's state tells them apart. A preempted job that exited 0
    before its grace time would otherwise be recorded COMPLETED mid-run and never resumed.
    """
    job_id = slurm_job_id()
    if job_id is None:
        return
    requeue_signal = signal.Signals[signal_name] if signal_name else None
    if requeue_signal not in received:
        state = slurm_job_state(job_id)
        if state == "CANCELLED":
            print(f"SLURM job {job_id} was cancelled: checkpoint saved, not requeueing", flush=True)
            return
    command = ["scontrol", "requeue", job_id]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RequeueFailed(f"checkpoint saved, but {' '.join(command)} failed: {err}; "
                            "resubmit the job to resume") from err
    if completed.returncode != 0:
        raise RequeueFailed(f"checkpoint saved, but {' '.join(command)} exited {completed.returncode}: "
                            f"{completed.stderr.strip()}; resubmit the job to resume")
    print(f"requeued SLURM job {job_id}: {' '.join(command)}", flush=True)


def slurm_job_state(job_id: str) -> Optional[str]:
    """JobState of `job_id` as `scontrol show job` reports it (e.g. RUNNING, CANCELLED), or None."""
    try:
        completed = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True,
                                   text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\bJobState=(\S+)", completed.stdout)
    return match.group(1) if match else None


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


def check_slurm_allocation(fabric_args: FabricArgs) -> None:
    """Under SLURM every rank is a task started by srun, so Fabric's ranks per node and nodes must
    be the allocation's. Fabric checks this too, but only after the data is loaded and with a
    message that names no config field."""
    if "SLURM_NTASKS" not in os.environ or os.environ.get("SLURM_JOB_NAME") in INTERACTIVE_JOB_NAMES:
        # Without SLURM or a launcher's rendezvous variables, the other nodes never join and the
        # process group would wait out its whole timeout.
        if fabric_args.num_nodes > 1 and not {"MASTER_ADDR", "NODE_RANK"} <= os.environ.keys():
            raise ConfigError("fabric.num_nodes", "1 outside SLURM (or every node started with MASTER_ADDR, "
                              "MASTER_PORT and NODE_RANK set)", fabric_args.num_nodes)
        return
    nodes = int(os.environ.get("SLURM_NNODES", "1"))
    # SLURM_NTASKS_PER_NODE is only set when the job asked for --ntasks-per-node.
    tasks_per_node = os.environ.get("SLURM_NTASKS_PER_NODE")
    tasks = int(tasks_per_node) if tasks_per_node else int(os.environ["SLURM_NTASKS"]) // nodes
    if fabric_args.devices != tasks:
        raise ConfigError("fabric.devices", f"the tasks per node of the SLURM allocation ({tasks})",
                          fabric_args.devices)
    if fabric_args.num_nodes != nodes:
        raise ConfigError("fabric.num_nodes", f"the nodes of the SLURM allocation ({nodes})", fabric_args.num_nodes)


def check_signal_name(signal_name: Optional[str]) -> None:
    if signal_name is None:
        return
    if signal_name not in signal.Signals.__members__ or signal_name in UNCATCHABLE_SIGNALS:
        raise ConfigError("checkpoint.requeue_signal", "a signal name such as SIGUSR1 (or null)", signal_name)
