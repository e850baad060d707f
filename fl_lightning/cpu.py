"""How a rank on the CPU uses the CPUs it may run on: torch's intra-op threads, OpenMP's wait policy,
and the kernels this CPU lacks.

Threads (`compute.cpu_threads`, `auto` by default), chosen from what benchmarks/cpu_threads.py
measured (docs/performance.md):

- a model of fewer than SMALL_MODEL_PARAMETERS parameters (LeNet-5, the MLPs) trains on one thread
  per rank. Its kernels are too small for threads to pay for their synchronisation: on a quiet
  machine one thread was as fast as two, or at most 1.6 times slower, and beside four busy loops
  OpenMP's threads waited on each other until a round took 6 to 28 times longer. More ranks
  (`fabric.devices: auto`, a rank per CPU) are how such a model uses more CPUs.
- a larger model (ResNet-18, ViT) trains on every CPU its rank may use: the CPUs of this process's
  affinity (what `taskset`, a container or a Slurm step binds it to), at most the cgroup's CPU quota,
  shared by the ranks this process starts on its node; under Slurm, a task's `SLURM_CPUS_PER_TASK`.
  Waiting threads sleep at once (OpenMP's passive wait policy, which the `fl-lightning` command sets
  before torch loads: `passive_wait_by_default`), so a busy machine slows such a run down no more
  than it slows one thread.
- `OMP_NUM_THREADS` in the environment leaves torch's threads as OpenMP sets them from it (and the
  wait policy to OpenMP's default); `compute.cpu_threads: N` sets N.
- a rank on a GPU leaves its host threads to OpenMP (OMP_NUM_THREADS, which a sweep sets per run):
  `compute.cpu_threads` is read on the CPU only.

`run_threads` is the rule as `fit` follows it and `sweep --mode estimate` times a run's steps with it.

The choice depends only on the settings and the CPUs the process is given, never on the machine's
load, so that a run resumed on the same machine computes bitwise what the uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

SMALL_MODEL_PARAMETERS = 1_000_000
"""Below this, one thread per rank (LeNet-5 has 62 thousand parameters, ResNet-18 11 million)."""
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass  # not frozen: Fabric's spawn launcher rebuilds the dataclasses it hands a rank
class ThreadChoice:
    threads: int
    """torch's intra-op threads in each rank."""
    reason: str

    def describe(self) -> str:
        return f"torch threads: {self.threads} per rank ({self.reason})"


def run_threads(on_cpu: bool, setting: Union[int, Literal["auto"]], parameters: int, ranks_per_node: int,
                environment: Optional[dict] = None, cpus: Optional[int] = None) -> Optional[ThreadChoice]:
    """The torch threads of each rank of a run, the same in every rank: on the CPU `choose_threads`;
    None on GPUs, where a rank's host threads are OpenMP's (OMP_NUM_THREADS) whatever
    `compute.cpu_threads` says."""
    if not on_cpu:
        return None
    return choose_threads(setting, parameters, ranks_per_node, environment, cpus)


def choose_threads(setting: Union[int, Literal["auto"]], parameters: int, ranks_per_node: int,
                   environment: Optional[dict] = None, cpus: Optional[int] = None) -> ThreadChoice:
    """The threads of each CPU rank of a run whose model has `parameters`, `ranks_per_node` ranks
    sharing the CPUs of its process (`cpus`: by default this process's, `available_cores`), by the
    module's rule; in this process, or (`environment` given) in a process started with `environment`."""
    if setting != "auto":
        return ThreadChoice(int(setting), "compute.cpu_threads")
    cpus = available_cores() if cpus is None else cpus
    if (environment if environment is not None else os.environ).get("OMP_NUM_THREADS"):
        return _openmp_threads(environment, cpus)
    if parameters < SMALL_MODEL_PARAMETERS:
        return ThreadChoice(1, f"auto: a model of {parameters:,} parameters trains fastest on one thread; more "
                               "ranks use more CPUs")
    threads, source = cpus_per_rank(ranks_per_node, os.environ if environment is None else environment, cpus)
    return ThreadChoice(threads, f"auto: {source}")


def _openmp_threads(environment: Optional[dict], cpus: int) -> ThreadChoice:
    """torch's threads as OpenMP sets them from OMP_NUM_THREADS: this process's own (`environment`
    None), or in a process started with `environment`, its first number (a nested list's outer level;
    OpenMP ignores a value that is not a number and takes the process's `cpus`)."""
    if environment is None:
        import torch

        return ThreadChoice(torch.get_num_threads(), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    value = environment["OMP_NUM_THREADS"]
    first = value.split(",")[0].strip()
    return ThreadChoice(int(first) if first.isdigit() and int(first) > 0 else cpus, f"OMP_NUM_THREADS={value}")


def cpus_per_rank(ranks_per_node: int, environment, cpus: int) -> tuple[int, str]:
    """The CPUs each rank may use of the process's `cpus`, and what decided them."""
    if environment.get("SLURM_CPUS_PER_TASK"):
        return (max(1, min(int(environment["SLURM_CPUS_PER_TASK"]), cpus)),
                f"SLURM_CPUS_PER_TASK={environment['SLURM_CPUS_PER_TASK']}")
    source = f"the {cpus} CPUs of this process's affinity"
    quota = cgroup_cpu_quota()
    if quota is not None and quota < cpus:
        cpus, source = max(1, math.floor(quota)), f"its cgroup's CPU quota of {quota:g} CPUs"
    if ranks_per_node > 1:
        return max(1, cpus // ranks_per_node), f"{source}, over {ranks_per_node} ranks"
    return cpus, source


def available_cores() -> int:
    """The CPUs this process may run on: its affinity where the platform reports one, else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, membership: Path = Path("/proc/self/cgroup")) -> Optional[float]:
    """The CPUs this process's cgroups allow (quota / period, the smallest along its cgroup v2 path,
    or cgroup v1's cpu controller); None where none is set or readable."""
    quotas = []
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: cpu.max of the process's cgroup and of each of its parents
            folder = root / path.lstrip("/")
            while True:
                quotas.append(_quota_v2(folder / "cpu.max"))
                if folder == root or root not in folder.parents:
                    break
                folder = folder.parent
        elif "cpu" in controllers.split(","):
            quotas.append(_quota_v1(root / "cpu" / path.lstrip("/")))
    found = [quota for quota in quotas if quota is not None]
    return min(found) if found else None


def _quota_v2(path: Path) -> Optional[float]:
    with contextlib.suppress(OSError, ValueError):
        quota, period = path.read_text().split()
        if quota != "max":
            return int(quota) / int(period)
    return None


def _quota_v1(folder: Path) -> Optional[float]:
    with contextlib.suppress(OSError, ValueError):
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        if quota > 0:
            return quota / int((folder / "cpu.cfs_period_us").read_text())
    return None


def passive_wait_by_default(environment: Optional[dict] = None) -> None:
    """OpenMP's waiting threads sleep at once unless the user chose threads or a wait policy: set in
    the command's process before torch loads (OpenMP reads it once), and so in every rank it starts.
    It changes nothing for a rank on one thread."""
    environment = os.environ if environment is None else environment
    if not {"OMP_NUM_THREADS", "OMP_WAIT_POLICY"} & environment.keys():
        environment["OMP_WAIT_POLICY"] = "PASSIVE"


@contextlib.contextmanager
def cpu_rank(choice: ThreadChoice, precision: str):
    """A CPU rank's threads, and its attention kernels, for the duration of its run (the caller's are
    put back: rank 0 may be a Python caller's process).

    torch 2.14's fused bf16 attention on the CPU needs AVX-512 for sequences of some lengths (it fails
    with "pack_vnni2 is only supported when avx512 is supported"): elsewhere a bf16 run computes
    attention with the math kernel."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(choice.threads)
    try:
        if precision.startswith("bf16") and torch.backends.cpu.get_cpu_capability() != "AVX512":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.MATH]):
                yield
        else:
            yield
    finally:
        torch.set_num_threads(threads)
