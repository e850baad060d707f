"""What a sweep asks of the machine: the plan's `resources:` as read from the plan file
(`PlanResources`, which resources.py honours), the sweep's options (`SweepOptions`), and the share of
this machine each local run gets (`Resources`, `plan_resources`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fl_lightning.cpu import available_cores
from fl_lightning.errors import ConfigError


@dataclass
class SweepOptions:
    """The options a sweep was given, as its modes and local.py, slurm.py, estimate.py and tuning.py read them."""

    jobs: Optional[int] = None
    gpus_per_run: Optional[int] = None
    """As given (None: the plan's), until the sweep settles it."""
    threads_per_run: Optional[int] = None
    index: Optional[int] = None
    sbatch_options: list[str] = field(default_factory=list)
    runs_root: Path = Path("runs")
    dry_run: bool = False
    overrides: list[str] = field(default_factory=list)
    """The command line's --override, as given (passed on to each SLURM array task)."""
    tuning_ended: bool = False


@dataclass
class Resources:
    """What each local run gets."""

    accelerator: str
    devices: int
    threads: int
    """On the CPU the CPUs of each run, on GPUs the OMP_NUM_THREADS of each rank."""
    gpu_slots: Optional[list[list[str]]]
    """Per slot (one run at a time each), the GPUs of CUDA_VISIBLE_DEVICES; None on the CPU."""
    cpu_slots: Optional[list[list[int]]] = None
    """Per slot, on the CPU, the CPUs its run is bound to (its affinity), from which the run chooses
    its threads as any CPU run does (fl_lightning.cpu); None where the platform binds no process to
    CPUs: its runs then get OMP_NUM_THREADS = threads."""

    def describe(self) -> str:
        if self.gpu_slots is None:
            return f"on the CPU, {self.threads} CPU(s) each"
        return f"on {self.devices} GPU(s) each ({self.threads} CPU thread(s) per rank)"


def plan_resources(jobs: int, gpus_per_run: int, threads_per_run: Optional[int]) -> Resources:
    """Share the machine between `jobs` runs without oversubscribing it; refuse what it cannot give."""
    cores = available_cores()
    if gpus_per_run == 0:
        if jobs > cores:
            raise ConfigError("jobs", f"at most the {cores} CPU cores of this machine for runs on the CPU "
                              "(or --gpus_per_run)", jobs)
        threads = threads_per_run or max(1, cores // jobs)
        if threads * jobs > cores:
            raise ConfigError("threads_per_run", f"at most {cores // jobs} with {jobs} runs at a time on {cores} "
                              "cores", threads)
        return Resources(accelerator="cpu", devices=1, threads=threads, gpu_slots=None,
                         cpu_slots=cpu_slots(jobs, threads))
    gpus = visible_gpus()
    if gpus_per_run > len(gpus):
        raise ConfigError("gpus_per_run", f"at most the {len(gpus)} GPU(s) visible here", gpus_per_run)
    if jobs * gpus_per_run > len(gpus):
        raise ConfigError("jobs", f"at most {len(gpus) // gpus_per_run} runs of {gpus_per_run} GPU(s) at a time "
                          f"({len(gpus)} GPU(s) visible: {','.join(gpus)})", jobs)
    threads = max(1, (threads_per_run or max(1, cores // jobs)) // gpus_per_run)
    slots = [gpus[slot * gpus_per_run:(slot + 1) * gpus_per_run] for slot in range(jobs)]
    return Resources(accelerator="gpu", devices=gpus_per_run, threads=threads, gpu_slots=slots)


def cpu_slots(jobs: int, cpus_per_run: int) -> Optional[list[list[int]]]:
    """`jobs` disjoint sets of `cpus_per_run` of the CPUs this process may use, where the platform binds
    processes to CPUs (Linux); else None. A run bound to its own CPUs neither takes more than its share
    nor has its threads wait on another run's: the rule of its threads (fl_lightning.cpu) sees them."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < jobs * cpus_per_run:  # fewer CPUs than the cores counted
        return None
    return [cpus[slot * cpus_per_run:(slot + 1) * cpus_per_run] for slot in range(jobs)]


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else every one torch sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    import torch

    return [str(gpu) for gpu in range(torch.cuda.device_count())]
