"""SLURM and preemption: signal handling, requeue, and checks against the allocation.

Fabric has no requeue logic (only the Trainer does), and the default action of SIGUSR1 kills the
process. So the run installs its own handler: it only records the request; the round loop turns
it into a checkpoint at the next round boundary, agreed on by every rank, after which rank 0
requeues the job and all ranks exit cleanly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Optional

from fl_lightning.config import ConfigError, FabricArgs

# Fabric's SLURMEnvironment.detect ignores allocations with these job names, so that processes can
# be started by hand inside `salloc` or `srun --pty bash`; the allocation check follows it.
INTERACTIVE_JOB_NAMES = ("bash", "interactive")
# These cannot be caught, so they could never ask for a checkpoint.
UNCATCHABLE_SIGNALS = ("SIGKILL", "SIGSTOP")


class PreemptionHandler:
    """Records that the job was asked to stop: by `signal_name` (what `sbatch --signal` sends
    ahead of the time limit) or by SIGTERM (what SLURM sends on scancel, preemption and timeout)."""

    def __init__(self, signal_name: Optional[str]):
        self.requested = False
        self._requeue_signal = signal.Signals[signal_name] if signal_name else None
        self._received: set[signal.Signals] = set()
        self._previous_handlers: dict[signal.Signals, object] = {}
        # Python lets only the main thread install handlers; a rank run in a thread goes without.
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in {signal.SIGTERM, self._requeue_signal} - {None}:
            self._previous_handlers[signum] = signal.signal(signum, self._record_request)

    def _record_request(self, signum: int, frame) -> None:
        # Only flags: the loop may be inside a collective, and saving from here would race the ranks.
        self._received.add(signal.Signals(signum))
        self.requested = True

    def requeue(self) -> None:
        """Put this SLURM job back in the queue (rank 0 calls it after the checkpoint). Outside
        SLURM nothing happens: the run has ended cleanly and the same command resumes it.

        A stop asked for by SIGTERM alone is not requeued: that is `scancel` (which must not bring
        the job back) or a preemption (which SLURM requeues by itself for `--requeue` jobs).
        """
        job_id = slurm_job_id()
        if job_id is None:
            return
        if signal.SIGTERM in self._received and self._requeue_signal not in self._received:
            print(f"stopped by SIGTERM: not requeueing SLURM job {job_id}", flush=True)
            return
        command = ["scontrol", "requeue", job_id]
        try:
            completed = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            print(f"requeue failed: {' '.join(command)}: {err}", file=sys.stderr, flush=True)
            return
        if completed.returncode != 0:
            print(f"requeue failed: {' '.join(command)} exited {completed.returncode}: {completed.stderr.strip()}",
                  file=sys.stderr, flush=True)
            return
        print(f"requeued SLURM job {job_id}: {' '.join(command)}", flush=True)

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous)
        self._previous_handlers.clear()


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
