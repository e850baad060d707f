"""What a local sweep asks of the machine: CPU runs share the cores and are bound to CPUs of their own, GPU runs
get GPUs of their own."""

import os
import sys

import pytest

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.sweeps import local as local_module
from fl_lightning.experiments.sweeps import machine as machine_module
from fl_lightning.experiments.sweeps.local import run_environment
from fl_lightning.experiments.sweeps.machine import plan_resources

pytestmark = pytest.mark.usefixtures("outside_slurm")  # a sweep here never submits or runs as a task


def test_cpu_runs_share_the_cores(monkeypatch):
    monkeypatch.setattr(machine_module, "available_cores", lambda: 8)
    assert plan_resources(jobs=2, gpus_per_run=0, threads_per_run=None).threads == 4
    assert plan_resources(jobs=3, gpus_per_run=0, threads_per_run=None).threads == 2
    assert plan_resources(jobs=1, gpus_per_run=0, threads_per_run=3).threads == 3
    with pytest.raises(ConfigError) as refused:
        plan_resources(jobs=2, gpus_per_run=0, threads_per_run=5)
    assert refused.value.field_name == "threads_per_run"
    with pytest.raises(ConfigError) as refused:
        plan_resources(jobs=9, gpus_per_run=0, threads_per_run=None)
    assert refused.value.field_name == "jobs"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="binds processes to CPUs (Linux)")
def test_cpu_runs_are_bound_to_cpus_of_their_own(tmp_path, monkeypatch):
    """Each run of a CPU sweep gets CPUs of its own, and chooses its threads from them (fl_lightning.cpu):
    the sweep gives it no thread count. Where there are fewer CPUs than counted, OMP_NUM_THREADS."""
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    resources = plan_resources(jobs=len(cpus), gpus_per_run=0, threads_per_run=None)
    assert resources.cpu_slots == [[cpu] for cpu in cpus]
    environment = run_environment(resources, len(cpus) - 1)
    assert "OMP_NUM_THREADS" not in environment and "MKL_NUM_THREADS" not in environment
    with open(tmp_path / "log", "wb") as log:
        process = local_module.start_run_process(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], environment, log,
            resources.cpu_slots[-1])
        assert process.wait(timeout=60) == 0
    assert (tmp_path / "log").read_text().strip() == str([cpus[-1]])

    monkeypatch.setattr(machine_module, "available_cores", lambda: 2 * len(cpus))
    resources = plan_resources(jobs=2, gpus_per_run=0, threads_per_run=None)
    assert resources.cpu_slots is None
    assert run_environment(resources, 0)["OMP_NUM_THREADS"] == str(len(cpus))


def test_gpu_runs_get_gpus_of_their_own(monkeypatch):
    monkeypatch.setattr(machine_module, "available_cores", lambda: 16)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("LOCAL_RANK", "2")
    resources = plan_resources(jobs=2, gpus_per_run=2, threads_per_run=None)
    assert (resources.accelerator, resources.devices, resources.threads) == ("gpu", 2, 4)
    environments = [run_environment(resources, slot) for slot in (0, 1)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in environments] == ["3,5", "6,7"]
    assert all(e["OMP_NUM_THREADS"] == "4" and "SLURM_JOB_ID" not in e and "LOCAL_RANK" not in e
               for e in environments)
    for jobs, gpus_per_run, field_name in [(3, 2, "jobs"), (1, 5, "gpus_per_run")]:
        with pytest.raises(ConfigError) as refused:
            plan_resources(jobs=jobs, gpus_per_run=gpus_per_run, threads_per_run=None)
        assert refused.value.field_name == field_name
