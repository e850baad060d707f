"""What each run of a plan needs (the plan's `resources:`), and how `fl-lightning sweep` honours it.

    resources: {gpus_per_run: 4, precision: bf16-mixed, time_per_run: "24:00:00", cpus_per_run: 16}

- `gpus_per_run` is the sweep's `--gpus_per_run` when the command line does not give it. A plan
  whose runs ask for GPUs (`gpus_per_run` > 0 here, or `fabric.accelerator: gpu` in their settings)
  is refused where it would train on the CPU: locally when no GPU is visible, and wherever
  `--gpus_per_run` would come to 0 (with `--slurm`, an array task without GPUs runs on the CPU).
  `--gpus_per_run N` on the command line overrides the plan, and says what it overrides:
  `--gpus_per_run 0` runs a GPU plan on the CPU on purpose.
- `precision` is every run's `fabric.precision`, given before the plan's configs; a grid point whose
  configs set another precision is refused (an `--override fabric.precision=...` replaces both).
- `time_per_run` is each array task's `sbatch --time` with `--slurm` (SLURM's forms: `MM`, `HH:MM:SS`,
  `D-HH:MM:SS`, ...; quoted in YAML, which reads 24:00:00 as a number); a `--time` in
  `--sbatch_options` overrides it, and says so.
- `cpus_per_run` is each array task's CPUs with `--slurm` (`--cpus-per-task` of its ranks, as
  `--threads_per_run`, which overrides it); a local run's threads are the machine's cores shared
  between `--jobs`.

With `--slurm`, a plan whose runs ask for GPUs is refused before sbatch when the partition its tasks
go to (the `--partition` of `--sbatch_options`, else the cluster's default) has none, as `sinfo`
reports it (nothing is checked where sinfo does not answer).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import Plan
from fl_lightning.experiments.plans.resolve import ResolvedPoint
from fl_lightning.experiments.sweeps.machine import SweepOptions, visible_gpus

GPU_ACCELERATORS = ("gpu", "cuda")
_TIME_OPTION = re.compile(r"(--time(=.*)?|-t.*)")
SINFO_TIMEOUT_S = 30


def gpus_per_run(plan: Plan, resolved: list[ResolvedPoint], given: Optional[int], slurm: bool) -> int:
    """The GPUs of each run: `given` (the command line's --gpus_per_run) over the plan's resources;
    refused when the plan asks for GPUs and the runs would get none (see the module docstring)."""
    asked = plan.resources.gpus_per_run
    on_gpus = [entry for entry in resolved
               if entry.config is not None and entry.config["fabric"]["accelerator"] in GPU_ACCELERATORS]
    if given is not None:
        if asked and given != asked:
            print(f"note: --gpus_per_run {given} overrides the plan's resources.gpus_per_run: {asked}"
                  + (" (its runs train on the CPU)" if given == 0 else ""), flush=True)
        elif given == 0 and on_gpus:
            print(f"note: --gpus_per_run 0 runs on the CPU the {len(on_gpus)} run(s) whose settings ask for "
                  f"fabric.accelerator {on_gpus[0].config['fabric']['accelerator']}", flush=True)
        return given
    if asked and not slurm:
        if not visible_gpus():
            raise ConfigError("gpus_per_run", f"GPUs visible here for plan {plan.name}, whose resources ask for "
                              f"{asked} per run (none is: no CUDA device, or CUDA_VISIBLE_DEVICES empty); give "
                              "--gpus_per_run 0 to train its runs on the CPU anyway",
                              f"{asked} (plan.resources.gpus_per_run)")
    if asked:
        return asked
    if on_gpus:
        entry = on_gpus[0]
        raise ConfigError("gpus_per_run", f"GPUs for plan {plan.name}, whose runs ask for them (fabric.accelerator "
                          f"{entry.config['fabric']['accelerator']} in the settings of {len(on_gpus)} grid point(s), "
                          f"first [{entry.point.index}]): state resources.gpus_per_run in the plan or give "
                          "--gpus_per_run N, or --gpus_per_run 0 to train them on the CPU",
                          "0 (the plan states no resources.gpus_per_run)")
    return 0


def check_precision(plan: Plan, resolved: list[ResolvedPoint]) -> None:
    """Refuse a plan some of whose points' configs set another precision than its resources state."""
    from fl_lightning.experiments.plans.resolve import PlanRefused, describe_point

    expected = plan.overrides.get("fabric.precision", plan.resources.precision)
    if expected is None:
        return
    different = [entry for entry in resolved
                 if entry.config is not None and entry.config["fabric"]["precision"] != expected]
    if different:
        raise PlanRefused("plan.resources.precision", f"the precision of every grid point ({expected}; a config "
                          "that sets fabric.precision disagrees with it)", plan.path,
                          [f"[{e.point.index}] {describe_point(e.point)}: fabric.precision "
                           f"{e.config['fabric']['precision']}" for e in different])


def array_job(plan: Plan, options: SweepOptions) -> None:
    """The plan's resources as the array job's options (its --time, its CPUs), where the command line
    leaves them; a GPU plan refused where its partition has no GPUs."""
    options.sbatch_options = [*time_options(plan, options.sbatch_options), *options.sbatch_options]
    options.threads_per_run = options.threads_per_run or plan.resources.cpus_per_run
    check_partition_gpus(plan, options.gpus_per_run, options.sbatch_options)


def check_partition_gpus(plan: Plan, gpus_per_run: int, sbatch_options: list[str]) -> None:
    """Refuse GPUs asked of partitions that have none, as sinfo reports the cluster (the partitions of
    the sbatch options, else the default one); no check where sinfo does not answer, nor of a
    partition it does not list (sbatch names that one)."""
    partitions = read_partitions() if gpus_per_run else None
    if partitions is None:
        return
    named = _partitions_asked(sbatch_options)
    asked = named or [partitions.default]
    with_gpus = partitions.with_gpus()
    if not all(name in partitions.gres for name in asked) or set(asked) & set(with_gpus):
        return
    where = f"partition {', '.join(asked)}" + ("" if named else " (the default)")
    choose = "a partition with GPUs in --sbatch_options"
    if with_gpus:
        choose = f'--sbatch_options "[--partition={with_gpus[0]}]"' + (
            f" (partitions with GPUs: {', '.join(with_gpus)})" if len(with_gpus) > 1 else "")
    raise ConfigError("gpus_per_run", f"a partition with GPUs for plan {plan.name}'s {gpus_per_run} GPU(s) per run: "
                      f"sinfo reports no GPU (gres) in {where}; give {choose}, or --gpus_per_run 0 to train its "
                      "runs on the CPU", gpus_per_run)


@dataclass
class Partitions:
    """The cluster's partitions as sinfo reports them."""

    gres: dict[str, list[str]]
    """Partition -> the generic resources of its nodes (`gpu:a100:4(S:0-1)`, `(null)`)."""
    default: Optional[str]

    def with_gpus(self) -> list[str]:
        return [name for name, resources in self.gres.items() if any("gpu" in r.lower() for r in resources)]


def read_partitions() -> Optional[Partitions]:
    """None where sinfo is not there or does not answer."""
    if shutil.which("sinfo") is None:
        return None
    try:
        completed = subprocess.run(["sinfo", "--noheader", "--format=%P %G"], capture_output=True, text=True,
                                   timeout=SINFO_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if completed.returncode != 0:
        return None
    partitions = Partitions(gres={}, default=None)
    for line in completed.stdout.splitlines():
        name, _, resources = line.strip().partition(" ")
        if name.endswith("*"):  # sinfo marks the default partition so
            name = partitions.default = name[:-1]
        if name:
            partitions.gres.setdefault(name, []).append(resources.strip())
    return partitions


def _partitions_asked(sbatch_options: list[str]) -> list[str]:
    """The partitions an sbatch command line names (--partition=a,b, --partition a, -p a, -pa); the last wins."""
    asked: list[str] = []
    for position, option in enumerate(sbatch_options):
        following = sbatch_options[position + 1] if position + 1 < len(sbatch_options) else ""
        if option.startswith("--partition="):
            asked = option.split("=", 1)[1].split(",")
        elif option in ("--partition", "-p"):
            asked = following.split(",")
        elif option.startswith("-p") and not option.startswith("--"):
            asked = option[2:].split(",")
    return [name for name in asked if name]


def time_options(plan: Plan, sbatch_options: list[str]) -> list[str]:
    """The array job's --time from the plan's resources, unless the sbatch options give one."""
    time = plan.resources.time_per_run
    if time is None:
        return []
    given = [option for option in sbatch_options if _TIME_OPTION.fullmatch(option)]
    if given:
        print(f"note: {given[-1]} (--sbatch_options) overrides the plan's resources.time_per_run: {time}", flush=True)
        return []
    return [f"--time={time}"]
