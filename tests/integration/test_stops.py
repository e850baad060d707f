"""Stops that stay stopped: a real `python -m fl_lightning fit` process, signalled the way Slurm
signals a job step (every process of it, W&B's service included) and given a stand-in `scontrol`,
must end with exit status 0, no traceback, and the job requeued exactly when it should be.

A run is signalled where it is known to be: after its last round (read from its console lines), or
held after round 2 (tests/support/holds.py) until its stop signal; and the signals go on until the process
has exited: a signal that lands during the interpreter's shutdown must not kill it either.
The tests that are about that shutdown run a fresh interpreter; the others a fork of a server that
has imported fl_lightning once (tests/support/processes.py), which exits as the interpreter would but
without the interpreter's own finalization.
"""

import itertools
import os
import signal
import subprocess
from pathlib import Path

import holds
import processes
import pytest
from fault_runs import (
    HELD_ROUND,
    HELD_RUN_ROUNDS,
    RUN_TIMEOUT_S,
    SLURM_JOB_ID,
    fit_command,
    held_run_arguments,
    process_environment,
)

# `show job` reports, as Slurm 22.05 does, the state in $STAND_IN_DIR/job_state and the restarts in
# $STAND_IN_DIR/restarts; `requeue` is recorded, then does what Slurm does on a requeue: SIGTERM to
# every process of the job step (the fit process and its children) before it returns.
pytestmark = pytest.mark.slow  # end to end: the tests train runs in-process or in subprocesses
STAND_IN_SCONTROL = """#!/bin/bash
if [[ $1 == show ]]; then
    echo "JobId=$4 JobName=fl JobState=$(cat "$STAND_IN_DIR/job_state") Reason=None Requeue=1 \\
Restarts=$(cat "$STAND_IN_DIR/restarts") BatchFlag=1"; exit 0
fi
echo "$@" >> "$STAND_IN_DIR/calls.txt"
for pid in $PPID $(ps -o pid= --ppid $PPID); do [[ $pid == $$ ]] || kill -TERM "$pid"; done
"""
# The stop signals the tests keep sending until the process has exited.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def start_fit(tmp_path: Path, *extra: str, fresh_interpreter: bool, **environment: str) -> subprocess.Popen:
    """`fit` started in a fresh interpreter (subprocess), or forked (tests/support/processes.py)."""
    command = fit_command(tmp_path / "run", "--checkpoint.requeue_signal", "SIGUSR1", *extra)
    with open(tmp_path / "stderr.txt", "w") as stderr:
        if fresh_interpreter:
            return subprocess.Popen(command, env=process_environment(**environment), stdout=subprocess.PIPE,
                                    stderr=stderr, text=True)
        return processes.Popen(command, env=process_environment(**environment), stdout=subprocess.PIPE,
                               stderr=stderr)


def read_until(process: subprocess.Popen, prefix: str) -> list[str]:
    """The console lines up to and with the first that starts with `prefix`."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    pytest.fail(f"the run exited {process.wait()} before a line starting {prefix!r}:\n{''.join(lines)}")


def step_processes(process: subprocess.Popen) -> list[int]:
    """The fit process and its children (W&B's service): what Slurm signals in a job step."""
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(process.pid)], capture_output=True, text=True)
    return [process.pid, *(int(pid) for pid in children.stdout.split())]


def signal_until_exit(process: subprocess.Popen, signums=STOP_SIGNALS) -> int:
    """Send `signums` in turn until the process exits; its exit status."""
    for count, signum in enumerate(itertools.cycle(signums)):
        if process.poll() is not None:
            return process.returncode
        assert count * 0.01 < RUN_TIMEOUT_S, "the process did not exit"
        process.send_signal(signum)
        try:
            return process.wait(timeout=0.01)
        except subprocess.TimeoutExpired:
            continue


def test_signals_after_the_last_round_never_kill_a_finished_run(tmp_path):
    """A time limit's SIGUSR1 just after the run finished, or a late SIGTERM: exit 0, not 138 or 143."""
    process = start_fit(tmp_path, "--federation.rounds", "3", "--logger.wandb_mode", "disabled",
                        fresh_interpreter=True)
    read_until(process, "finished at round 3/3")
    assert signal_until_exit(process) == 0, (tmp_path / "stderr.txt").read_text()


@pytest.fixture
def slurm_job(tmp_path):
    """A stand-in `scontrol` first on PATH, and the variables of a SLURM job, for `start_fit`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(STAND_IN_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    return {"SLURM_JOB_ID": SLURM_JOB_ID, "STAND_IN_DIR": str(tmp_path),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


# The job's state and Restarts as `scontrol show job` reports them after the signal (the attempt
# started as restart 0), the signal, the requeue calls expected, what the run says, and whether the
# stop runs in a fresh interpreter, signalled through its own shutdown, W&B's service and the
# requeue's SIGTERM included; the other two are forked.
STOPS = {
    # sbatch --signal=USR1@T (or scancel -s USR1): checkpoint, requeue, whose SIGTERM reaches every
    # process of the step, then signals until exit (a second time-limit signal, a second TERM).
    "requeue signal": ("RUNNING", 0, signal.SIGUSR1,
                       ["requeue 4242"], f"requeued SLURM job {SLURM_JOB_ID}: scontrol requeue {SLURM_JOB_ID}", True),
    # scancel: SIGTERM to every process of the step while Slurm reports the job COMPLETING.
    "scancel": ("COMPLETING", 0, signal.SIGTERM,
                [], f"SLURM job {SLURM_JOB_ID} is COMPLETING (cancelled or ending): checkpoint saved, not requeueing",
                False),
    # Preemption with GraceTime=0, or a hand `scontrol requeue`: Slurm requeues the job itself and
    # signals the step; it reports the job COMPLETING, as after scancel, but with one more restart.
    "requeued by Slurm": ("COMPLETING", 1, signal.SIGTERM, [],
                          f"SLURM job {SLURM_JOB_ID} is already back in the queue (COMPLETING, Restarts=1 where this "
                          "attempt started at 0): checkpoint saved, the requeued job resumes from it", False),
}


@pytest.mark.parametrize("state, restarts, signum, requeue_calls, said, fresh_interpreter", STOPS.values(),
                         ids=STOPS.keys())
def test_a_stop_under_slurm_exits_0_without_a_traceback(state, restarts, signum, requeue_calls, said, fresh_interpreter,
                                                       slurm_job, tmp_path):
    (tmp_path / "job_state").write_text(state)
    (tmp_path / "restarts").write_text(str(restarts))
    # Held after round HELD_ROUND until signalled (tests/support/holds.py): the stop comes at the end of the next.
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "hold").touch()
    process = start_fit(tmp_path, "--logger.wandb_mode", "offline", *held_run_arguments(),
                        fresh_interpreter=fresh_interpreter, PYTHONPATH=holds.pythonpath(), **slurm_job)
    processes.wait_until(lambda: (out_dir / "held_rank0").exists(), [process],
                         f"the run held after round {HELD_ROUND}", RUN_TIMEOUT_S)
    for pid in step_processes(process):
        os.kill(pid, signum)
    status = signal_until_exit(process)
    stdout, stderr = process.stdout.read(), (tmp_path / "stderr.txt").read_text()
    assert status == 0, stderr
    assert said in stdout
    assert f"checkpoint saved) at round {HELD_ROUND + 1}/{HELD_RUN_ROUNDS}" in stdout, stdout
    calls = tmp_path / "calls.txt"
    assert (calls.read_text().splitlines() if calls.exists() else []) == requeue_calls
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
