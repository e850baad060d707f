"""Each CPU rank's torch threads (compute.cpu_threads: auto): one thread for a small model, else the CPUs of the
rank (affinity, cgroup quota, SLURM_CPUS_PER_TASK, shared by the node's ranks); OMP_NUM_THREADS or the setting
first; OpenMP's passive wait unless threads or a policy were chosen."""

import os

import pytest
import torch

from fl_lightning import cpu
from fl_lightning.cpu import (
    ThreadChoice,
    available_cores,
    cgroup_cpu_quota,
    choose_threads,
    cpu_rank,
    passive_wait_by_default,
    run_threads,
)


def test_cores_are_the_ones_this_process_may_run_on(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert available_cores() == 3
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert available_cores() == 64


SMALL, LARGE = cpu.SMALL_MODEL_PARAMETERS - 1, cpu.SMALL_MODEL_PARAMETERS


def test_a_small_model_trains_on_one_thread_per_rank(cpus):
    cpus(16)
    choice = choose_threads("auto", SMALL, ranks_per_node=1, environment={})
    assert choice.threads == 1
    assert choice.describe() == ("torch threads: 1 per rank (auto: a model of 999,999 parameters trains fastest on "
                                 "one thread; more ranks use more CPUs)")


@pytest.mark.parametrize("cores, quota, ranks, environment, threads, source", [
    (8, None, 1, {}, 8, "the 8 CPUs of this process's affinity"),
    (8, None, 3, {}, 2, "the 8 CPUs of this process's affinity, over 3 ranks"),
    (2, None, 4, {}, 1, "the 2 CPUs of this process's affinity, over 4 ranks"),
    (8, 2.5, 1, {}, 2, "its cgroup's CPU quota of 2.5 CPUs"),
    (8, 0.5, 1, {}, 1, "its cgroup's CPU quota of 0.5 CPUs"),
    (8, 16.0, 2, {}, 4, "the 8 CPUs of this process's affinity, over 2 ranks"),
    # A Slurm task's own CPUs (its ranks are tasks of their own), never more than it may run on.
    (64, None, 4, {"SLURM_CPUS_PER_TASK": "6"}, 6, "SLURM_CPUS_PER_TASK=6"),
    (4, None, 4, {"SLURM_CPUS_PER_TASK": "6"}, 4, "SLURM_CPUS_PER_TASK=6"),
])
def test_a_larger_model_trains_on_the_cpus_of_its_rank(cpus, cores, quota, ranks, environment, threads, source):
    cpus(cores, quota)
    assert choose_threads("auto", LARGE, ranks_per_node=ranks, environment=environment) == \
        ThreadChoice(threads, f"auto: {source}")


def test_omp_num_threads_and_the_setting_take_precedence(monkeypatch):
    # In this process, torch's threads as OpenMP set them; in a process started with an environment,
    # the number it gives OpenMP (a nested list's outer level; not a number: OpenMP's default, the CPUs).
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    try:
        assert choose_threads("auto", SMALL, 1) == ThreadChoice(3, "OMP_NUM_THREADS=3")
    finally:
        torch.set_num_threads(previous)
    assert choose_threads("auto", LARGE, 1, {"OMP_NUM_THREADS": "4"}) == ThreadChoice(4, "OMP_NUM_THREADS=4")
    assert choose_threads("auto", LARGE, 1, {"OMP_NUM_THREADS": "4,2"}, cpus=8).threads == 4
    assert choose_threads("auto", LARGE, 1, {"OMP_NUM_THREADS": "many"}, cpus=8).threads == 8
    assert choose_threads(5, LARGE, 2, {"OMP_NUM_THREADS": "3"}) == ThreadChoice(5, "compute.cpu_threads")


def test_on_gpus_a_rank_leaves_its_threads_to_openmp_whatever_the_setting():
    """The rule fit follows and the estimate prices with (tests/experiments/sweeps/test_estimate.py)."""
    assert run_threads(False, 4, LARGE, 1, {}) is None
    assert run_threads(False, "auto", LARGE, 1, {}) is None
    assert run_threads(True, 4, LARGE, 1, {}) == ThreadChoice(4, "compute.cpu_threads")
    assert run_threads(True, "auto", SMALL, 2, {}) == choose_threads("auto", SMALL, 2, {})


def test_the_cgroup_quota_is_the_smallest_along_the_path(tmp_path):
    membership = tmp_path / "cgroup"
    root = tmp_path / "fs"
    (root / "job" / "step").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "job" / "cpu.max").write_text("150000 100000\n")
    (root / "job" / "step" / "cpu.max").write_text("max 100000\n")
    membership.write_text("0::/job/step\n")
    assert cgroup_cpu_quota(root, membership) == 1.5
    (root / "job" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(root, membership) is None
    # cgroup v1: the cpu controller's quota of the process's cgroup.
    (root / "cpu" / "job").mkdir(parents=True)
    (root / "cpu" / "job" / "cpu.cfs_quota_us").write_text("300000\n")
    (root / "cpu" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    membership.write_text("4:memory:/job\n1:cpu,cpuacct:/job\n")
    assert cgroup_cpu_quota(root, membership) == 3.0
    assert cgroup_cpu_quota(root, tmp_path / "no such file") is None


def test_waiting_threads_sleep_unless_threads_or_a_policy_were_chosen():
    for environment, policy in [({}, "PASSIVE"), ({"OMP_NUM_THREADS": "4"}, None),
                                ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE")]:
        passive_wait_by_default(environment)
        assert environment.get("OMP_WAIT_POLICY") == policy


def test_bf16_attention_takes_the_math_kernel_on_a_cpu_without_avx512(monkeypatch):
    """torch's fused bf16 attention on the CPU fails without AVX-512 (fl_lightning.cpu.cpu_rank)."""
    choice = ThreadChoice(1, "test")
    for capability, precision, flash in [("AVX2", "bf16-mixed", False), ("DEFAULT", "bf16-true", False),
                                         ("AVX512", "bf16-mixed", True), ("AVX2", "32-true", True)]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        with cpu_rank(choice, precision):
            assert torch.backends.cuda.flash_sdp_enabled() is flash, (capability, precision)
        assert torch.backends.cuda.flash_sdp_enabled()
