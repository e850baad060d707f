import os
import signal
import threading

import pytest

from fl_lightning.cluster import PreemptionHandler, check_signal_name, check_slurm_allocation
from fl_lightning.config import ConfigError, FabricArgs


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch):
    """Each test starts outside SLURM, whatever the shell running pytest has set."""
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)


@pytest.fixture
def scontrol_calls(tmp_path, monkeypatch):
    """A stand-in `scontrol` first on PATH; returns the file each call appends its arguments to."""
    calls = tmp_path / "scontrol_calls.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "scontrol"
    stand_in.write_text(f'#!/bin/bash\necho "$@" >> {calls}\n')
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


@pytest.mark.parametrize("signal_name, sent", [("SIGUSR1", signal.SIGUSR1), ("SIGUSR1", signal.SIGTERM),
                                               (None, signal.SIGTERM)])
def test_signal_sets_only_the_flag(signal_name, sent):
    handler = PreemptionHandler(signal_name)
    try:
        assert not handler.requested
        os.kill(os.getpid(), sent)  # the Python handler runs before the next line
        assert handler.requested
    finally:
        handler.restore()


def test_restore_puts_back_the_previous_handlers():
    def previous_usr1(signum, frame):
        pass

    before_usr1 = signal.signal(signal.SIGUSR1, previous_usr1)
    before_term = signal.getsignal(signal.SIGTERM)
    try:
        handler = PreemptionHandler("SIGUSR1")
        assert signal.getsignal(signal.SIGUSR1) not in (previous_usr1, before_usr1)
        handler.restore()
        assert signal.getsignal(signal.SIGUSR1) is previous_usr1
        assert signal.getsignal(signal.SIGTERM) == before_term
    finally:
        signal.signal(signal.SIGUSR1, before_usr1)


def test_outside_the_main_thread_no_handler_is_installed():
    before = signal.getsignal(signal.SIGUSR1)
    handlers = []
    worker = threading.Thread(target=lambda: handlers.append(PreemptionHandler("SIGUSR1")))
    worker.start()
    worker.join()
    assert not handlers[0].requested
    assert signal.getsignal(signal.SIGUSR1) == before
    handlers[0].restore()
    assert signal.getsignal(signal.SIGUSR1) == before


@pytest.mark.parametrize("environment, requeued_id", [
    ({"SLURM_JOB_ID": "4242"}, "4242"),
    ({"SLURM_JOB_ID": "4250", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "7"}, "4242_7"),
])
def test_requeue_calls_scontrol_with_the_job_id(environment, requeued_id, scontrol_calls, monkeypatch, capsys):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    handler = PreemptionHandler("SIGUSR1")
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        handler.requeue()
    finally:
        handler.restore()
    assert scontrol_calls.read_text().splitlines() == [f"requeue {requeued_id}"]
    assert f"requeued SLURM job {requeued_id}" in capsys.readouterr().out


def test_requeue_when_another_rank_was_signalled(scontrol_calls, monkeypatch):
    # Rank 0 requeues when the all-reduce says some rank got the requeue signal, even if it got none.
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    PreemptionHandler("SIGUSR1").requeue()
    assert scontrol_calls.read_text().splitlines() == ["requeue 4242"]


def test_without_slurm_requeue_does_nothing(scontrol_calls, capsys):
    PreemptionHandler("SIGUSR1").requeue()
    assert not scontrol_calls.exists()
    assert capsys.readouterr().out == ""


def test_sigterm_alone_does_not_requeue(scontrol_calls, monkeypatch, capsys):
    """SIGTERM is scancel or a preemption: a cancelled job must stay cancelled."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    handler = PreemptionHandler("SIGUSR1")
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        handler.requeue()
    finally:
        handler.restore()
    assert handler.requested
    assert not scontrol_calls.exists()
    assert "not requeueing SLURM job 4242" in capsys.readouterr().out


def test_failing_scontrol_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "Invalid job id specified" >&2\nexit 1\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    PreemptionHandler("SIGUSR1").requeue()
    stderr = capsys.readouterr().err
    assert "requeue failed: scontrol requeue 4242 exited 1" in stderr
    assert "Invalid job id specified" in stderr


def test_missing_scontrol_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no scontrol anywhere
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    PreemptionHandler("SIGUSR1").requeue()
    assert "requeue failed: scontrol requeue 4242" in capsys.readouterr().err


SLURM_TWO_NODES_OF_FOUR = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "fl", "SLURM_NTASKS": "8",
                           "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2"}


@pytest.mark.parametrize("environment, fabric_args, field_name", [
    (SLURM_TWO_NODES_OF_FOUR, FabricArgs(devices=2, num_nodes=2), "fabric.devices"),
    (SLURM_TWO_NODES_OF_FOUR, FabricArgs(devices="auto", num_nodes=2), "fabric.devices"),
    (SLURM_TWO_NODES_OF_FOUR, FabricArgs(devices=4, num_nodes=1), "fabric.num_nodes"),
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
    ({}, FabricArgs(devices=3, num_nodes=5)),  # not under SLURM
    (SLURM_TWO_NODES_OF_FOUR, FabricArgs(devices=4, num_nodes=2)),
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
