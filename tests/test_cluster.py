import os
import signal
import threading

import pytest

from fl_lightning.cluster import (
    RequeueFailed,
    StopSignals,
    check_signal_name,
    check_slurm_allocation,
    requeue_after_stop,
)
from fl_lightning.config import FabricArgs
from fl_lightning.errors import ConfigError


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch):
    """Each test starts outside SLURM and any launcher, whatever the shell running pytest has set."""
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
            monkeypatch.delenv(name)


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A stand-in `scontrol` first on PATH: `show job` reports, as Slurm 22.05 does, the state in the
    file `job_state` (RUNNING unless a test writes another) and the restarts in `restarts` (0 unless
    a test writes another); `requeue` appends its arguments to `calls`, and fails with the message in
    the file `requeue_error` if a test writes one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls, job_state, restarts = tmp_path / "scontrol_calls.txt", tmp_path / "job_state", tmp_path / "restarts"
    requeue_error = tmp_path / "requeue_error"
    job_state.write_text("RUNNING")
    restarts.write_text("0")
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\n'
        f'if [[ "$1" == show ]]; then echo "JobId=$4 JobName=fl JobState=$(cat {job_state}) Reason=None '
        f'Requeue=1 Restarts=$(cat {restarts}) BatchFlag=1"; exit 0; fi\n'
        f'echo "$@" >> {calls}\n'
        f'if [[ -f {requeue_error} ]]; then cat {requeue_error} >&2; exit 1; fi\n'
    )
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return {"calls": calls, "job_state": job_state, "restarts": restarts, "requeue_error": requeue_error}


@pytest.fixture
def stop_signals():
    recorder = StopSignals()
    installed = []
    yield recorder, installed
    recorder.uninstall(installed)


@pytest.mark.parametrize("signal_name, sent", [("SIGUSR1", signal.SIGUSR1), ("SIGUSR1", signal.SIGTERM),
                                               (None, signal.SIGTERM), ("SIGUSR2", signal.SIGUSR2)])
def test_signal_sets_only_the_flag(signal_name, sent, stop_signals):
    recorder, installed = stop_signals
    installed += recorder.install(signal_name)
    assert not recorder.requested
    os.kill(os.getpid(), sent)  # the Python handler runs before the next line
    assert recorder.received == {sent}


def test_a_second_install_adds_only_new_signals_and_uninstall_restores_each(stop_signals):
    def previous_usr1(signum, frame):
        pass

    recorder, installed = stop_signals
    before_usr1 = signal.signal(signal.SIGUSR1, previous_usr1)
    before_term = signal.getsignal(signal.SIGTERM)
    try:
        first = recorder.install("SIGUSR1")
        assert sorted(first) == [signal.SIGUSR1, signal.SIGTERM]
        assert recorder.install("SIGUSR1") == []  # the command line installed them already
        second = recorder.install("SIGUSR2")
        assert second == [signal.SIGUSR2]
        os.kill(os.getpid(), signal.SIGUSR1)
        recorder.uninstall(second)
        assert recorder.requested  # still recording SIGUSR1 and SIGTERM
        recorder.uninstall(first)
        assert not recorder.requested
        assert signal.getsignal(signal.SIGUSR1) is previous_usr1
        assert signal.getsignal(signal.SIGTERM) == before_term
    finally:
        signal.signal(signal.SIGUSR1, before_usr1)


@pytest.fixture
def handlers_restored():
    """The test may leave SIGTERM, SIGUSR1 and SIGUSR2 ignored: they are put back afterwards."""
    signums = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    before = {signum: signal.getsignal(signum) for signum in signums}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_the_command_lines_signals_are_ignored_once_its_run_is_over(handlers_restored):
    """Python gives back a handled signal's default action (death) while the interpreter shuts
    down; an ignored signal stays ignored. The run's own signal (here SIGUSR2) is ignored as soon
    as the run ends, the command line's own once its command is done."""
    recorder = StopSignals()
    recorder.hold_until_exit("SIGUSR1")
    assert signal.getsignal(signal.SIGTERM) == recorder._record
    run_signals = recorder.install("SIGUSR2")  # what StopOnSignal does for checkpoint.requeue_signal SIGUSR2
    assert run_signals == [signal.SIGUSR2]
    recorder.uninstall(run_signals)
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGUSR1)  # between the run's end and the command's: still recorded
    assert recorder.received == {signal.SIGUSR1}
    recorder.ignore_until_exit()
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)] == [signal.SIG_IGN, signal.SIG_IGN]
    os.kill(os.getpid(), signal.SIGTERM)
    assert recorder.received == {signal.SIGUSR1}


def test_outside_the_main_thread_no_handler_is_installed():
    before = signal.getsignal(signal.SIGUSR1)
    recorder = StopSignals()
    installed = []
    worker = threading.Thread(target=lambda: installed.extend(recorder.install("SIGUSR1")))
    worker.start()
    worker.join()
    assert installed == []
    assert signal.getsignal(signal.SIGUSR1) == before


@pytest.mark.parametrize("environment, requeued_id", [
    ({"SLURM_JOB_ID": "4242"}, "4242"),
    ({"SLURM_JOB_ID": "4250", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "7"}, "4242_7"),
])
def test_requeue_calls_scontrol_with_the_job_id(environment, requeued_id, scontrol, monkeypatch, capsys):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    requeue_after_stop("SIGUSR1", {signal.SIGUSR1})
    assert scontrol["calls"].read_text().splitlines() == [f"requeue {requeued_id}"]
    assert f"requeued SLURM job {requeued_id}" in capsys.readouterr().out


def test_requeue_when_another_rank_was_signalled(scontrol, monkeypatch):
    # Rank 0 requeues when the all-reduce says some rank asked to stop, even if it got no signal.
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    requeue_after_stop("SIGUSR1", set())
    assert scontrol["calls"].read_text().splitlines() == ["requeue 4242"]


def test_without_slurm_requeue_does_nothing(scontrol, capsys):
    requeue_after_stop("SIGUSR1", {signal.SIGUSR1})
    assert not scontrol["calls"].exists()
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("received", [{signal.SIGTERM}, {signal.SIGUSR1, signal.SIGTERM}, set()],
                         ids=["SIGTERM", "requeue signal then SIGTERM", "another rank's signal"])
@pytest.mark.parametrize("state", ["COMPLETING", "CANCELLED", "TIMEOUT", "COMPLETED", "PREEMPTED", "FAILED"])
def test_a_cancelled_or_ending_job_is_not_requeued(state, received, scontrol, monkeypatch, capsys):
    """scancel marks the job before it signals the steps, and Slurm 22.05 reports it COMPLETING
    while they are killed: a cancelled job must stay cancelled, also after an earlier requeue signal."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    scontrol["job_state"].write_text(state)
    requeue_after_stop("SIGUSR1", received)
    assert not scontrol["calls"].exists()
    printed = capsys.readouterr().out
    assert f"SLURM job 4242 is {state} (cancelled or ending): checkpoint saved, not requeueing" in printed


def test_sigterm_of_a_job_still_running_requeues(scontrol, monkeypatch):
    """Preemption with a grace time sends SIGTERM while the job stays RUNNING; exiting 0 without a
    requeue would leave the job COMPLETED mid-run."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    requeue_after_stop("SIGUSR1", {signal.SIGTERM})
    assert scontrol["calls"].read_text().splitlines() == ["requeue 4242"]


@pytest.mark.parametrize("state", ["COMPLETING", "PENDING", "REQUEUED"])
@pytest.mark.parametrize("attempt_restarts", [None, "2"], ids=["first attempt", "third attempt"])
def test_a_job_slurm_has_requeued_itself_is_left_in_the_queue(state, attempt_restarts, scontrol, monkeypatch, capsys):
    """Preemption with GraceTime=0, or a hand `scontrol requeue`: Slurm requeues the job itself, counts
    it in Restarts and, in 22.05, reports it COMPLETING while it kills the steps, as it reports a
    cancelled job. Advice to submit the job again would start a second job racing this one."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    if attempt_restarts is not None:
        monkeypatch.setenv("SLURM_RESTART_COUNT", attempt_restarts)
    restarts = int(attempt_restarts or 0) + 1
    scontrol["job_state"].write_text(state)
    scontrol["restarts"].write_text(str(restarts))
    requeue_after_stop("SIGUSR1", {signal.SIGTERM})
    assert not scontrol["calls"].exists()
    printed = capsys.readouterr().out
    assert f"SLURM job 4242 is already back in the queue ({state}, Restarts={restarts} where this attempt started " \
           f"at {restarts - 1}): checkpoint saved, the requeued job resumes from it" in printed
    assert "not requeueing" not in printed and "submitted again" not in printed


def test_a_requeued_job_cancelled_later_is_not_requeued(scontrol, monkeypatch, capsys):
    """`scancel` of an attempt that a requeue started: its Restarts are the attempt's own."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    scontrol["job_state"].write_text("COMPLETING")
    scontrol["restarts"].write_text("1")
    requeue_after_stop("SIGUSR1", {signal.SIGTERM})
    assert not scontrol["calls"].exists()
    assert "SLURM job 4242 is COMPLETING (cancelled or ending): checkpoint saved, not requeueing; the same command " \
           "submitted again resumes the run" in capsys.readouterr().out


def test_a_requeue_refused_as_pending_execution_is_a_success(scontrol, monkeypatch, capsys):
    """Slurm requeued the job between the state read and `scontrol requeue`: resubmitting it, as a
    failure would advise, would start a second job racing the first."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    scontrol["requeue_error"].write_text("Requeue of JobId=4242 failed: Job is pending execution")
    requeue_after_stop("SIGUSR1", {signal.SIGUSR1})
    assert scontrol["calls"].read_text().splitlines() == ["requeue 4242"]
    assert "SLURM job 4242 is already back in the queue (Requeue of JobId=4242 failed: Job is pending execution)" \
        in capsys.readouterr().out


def test_sigterm_with_an_unreadable_job_state_is_not_requeued_and_says_so(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {calls}\n'
                                      '[[ $1 == show ]] && { echo "Socket timed out" >&2; exit 1; }\nexit 0\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(RequeueFailed, match=r"state of SLURM job 4242 could not be read \(scontrol show job "
                                            r"--oneliner 4242 exited 1: Socket timed out\).*not requeued"):
        requeue_after_stop("SIGUSR1", {signal.SIGTERM})
    assert "requeue" not in calls.read_text()
    requeue_after_stop("SIGUSR1", {signal.SIGUSR1})  # the requeue signal needs no state to be read
    assert calls.read_text().splitlines()[-1] == "requeue 4242"


def test_failing_scontrol_raises_naming_the_command(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "Invalid job id specified" >&2\nexit 1\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(RequeueFailed, match="scontrol requeue 4242 exited 1: Invalid job id specified"):
        requeue_after_stop("SIGUSR1", {signal.SIGUSR1})


def test_missing_scontrol_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no scontrol anywhere
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(RequeueFailed, match="scontrol requeue 4242 failed"):
        requeue_after_stop("SIGUSR1", {signal.SIGUSR1})


SLURM_TWO_NODES_OF_FOUR = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "fl", "SLURM_NTASKS": "8",
                           "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2"}


@pytest.mark.parametrize("environment, fabric_args, field_name", [
    (SLURM_TWO_NODES_OF_FOUR, FabricArgs(devices=2, num_nodes=2), "fabric.devices"),
    (SLURM_TWO_NODES_OF_FOUR, FabricArgs(devices=4, num_nodes=1), "fabric.num_nodes"),
    # Outside SLURM no other node would ever join: the process group would wait out its timeout.
    ({}, FabricArgs(devices=1, num_nodes=2), "fabric.num_nodes"),
    ({"MASTER_ADDR": "127.0.0.1"}, FabricArgs(devices=1, num_nodes=2), "fabric.num_nodes"),
    # Without --ntasks-per-node SLURM sets no SLURM_NTASKS_PER_NODE: tasks / nodes per node.
    ({"SLURM_JOB_NAME": "fl", "SLURM_NTASKS": "6", "SLURM_NNODES": "3"}, FabricArgs(devices=1, num_nodes=3),
     "fabric.devices"),
])
def test_allocation_mismatch_names_the_field(environment, fabric_args, field_name, monkeypatch):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as raised:
        check_slurm_allocation(fabric_args)
    assert raised.value.field_name == field_name
    assert str(raised.value).startswith(field_name + ":")


@pytest.mark.parametrize("environment, fabric_args", [
    ({}, FabricArgs(devices=3, num_nodes=1)),  # not under SLURM
    ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "1"}, FabricArgs(devices=3, num_nodes=5)),
    (SLURM_TWO_NODES_OF_FOUR, FabricArgs(devices=4, num_nodes=2)),
    (SLURM_TWO_NODES_OF_FOUR, FabricArgs(devices="auto", num_nodes=2)),  # auto is the allocation's tasks per node
    ({"SLURM_JOB_NAME": "fl", "SLURM_NTASKS": "6", "SLURM_NNODES": "3"}, FabricArgs(devices=2, num_nodes=3)),
    # An interactive allocation, where ranks are started by hand: Fabric does not treat it as SLURM.
    ({**SLURM_TWO_NODES_OF_FOUR, "SLURM_JOB_NAME": "interactive"}, FabricArgs(devices=1, num_nodes=1)),
    ({**SLURM_TWO_NODES_OF_FOUR, "SLURM_JOB_NAME": "bash"}, FabricArgs(devices=1, num_nodes=1)),
])
def test_matching_or_no_allocation_passes(environment, fabric_args, monkeypatch):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    check_slurm_allocation(fabric_args)


@pytest.mark.parametrize("signal_name", [None, "SIGUSR1", "SIGUSR2", "SIGTERM"])
def test_valid_signal_names(signal_name):
    check_signal_name(signal_name)


@pytest.mark.parametrize("signal_name", ["USR1", "sigusr1", "SIGNOPE", "", "SIGKILL", "SIGSTOP"])
def test_invalid_signal_names(signal_name):
    with pytest.raises(ConfigError) as raised:
        check_signal_name(signal_name)
    assert raised.value.field_name == "checkpoint.requeue_signal"
