"""Which rank is gone, as the ranks left name it from gloo's error and the ranks' processes told at
the start of the run (the two-rank runs killed for real are in tests/integration/test_faults.py)."""

import os
import subprocess

from fl_lightning.errors import RankLost
from fl_lightning.lost_ranks import RankProcess, RankProcesses

GLOO_PEER_CLOSED = RuntimeError(
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.0.0.2]:41232. This is "
    "typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error.")


def ended_process() -> int:
    """The pid of a process of this host that has ended, and been waited for."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_the_rank_of_this_host_whose_process_ended_is_named_among_several():
    ranks = RankProcesses([RankProcess(0, "node-a", os.getpid()), RankProcess(1, "node-a", ended_process()),
                           RankProcess(2, "node-a", os.getppid()), RankProcess(3, "node-b", 7)], own_rank=0)
    lost = ranks.lost(GLOO_PEER_CLOSED, round_number=5)
    assert isinstance(lost, RankLost) and lost.exit_status == 75
    assert str(lost) == (f"round 5: rank 1 (pid {ranks.processes[1].pid} on node-a) is gone (gloo: Connection closed "
                         "by peer [10.0.0.2]:41232)")


def test_a_killed_process_its_parent_has_not_waited_for_is_gone():
    process = subprocess.Popen(["true"])
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)  # ended, left a zombie until waited for
    try:
        ranks = RankProcesses([RankProcess(0, "node-a", os.getpid()), RankProcess(1, "node-a", process.pid),
                               RankProcess(2, "node-a", os.getppid())], own_rank=0)
        assert str(ranks.lost(GLOO_PEER_CLOSED, 2)).startswith(f"round 2: rank 1 (pid {process.pid} on node-a) is gone")
    finally:
        process.wait()


def test_the_rank_of_another_host_is_left_to_the_address_gloo_names_among_several():
    ranks = RankProcesses([RankProcess(0, "node-a", os.getpid()), RankProcess(1, "node-b", 7),
                           RankProcess(2, "node-c", 8)], own_rank=0)
    assert str(ranks.lost(GLOO_PEER_CLOSED, 3)) == ("round 3: a rank of another host is gone (gloo: Connection closed "
                                                    "by peer [10.0.0.2]:41232)")
    two = RankProcesses([RankProcess(0, "node-a", 6), RankProcess(1, "node-b", 7)], own_rank=1)
    assert str(two.lost(GLOO_PEER_CLOSED, 3)).startswith("round 3: rank 0 (pid 6 on node-a) is gone")


def test_other_errors_are_no_lost_rank():
    ranks = RankProcesses([RankProcess(0, "node-a", os.getpid()), RankProcess(1, "node-b", 7)], own_rank=0)
    assert ranks.lost(RuntimeError("CUDA out of memory"), 1) is None
    assert ranks.lost(ValueError("Connection closed by peer"), 1) is None
    assert RankProcesses([RankProcess(0, "node-a", os.getpid())], 0).lost(GLOO_PEER_CLOSED, 1) is None
