"""What each run of a plan needs (the plan's `resources:`), and how `fl-lightning sweep` honours it.

    resources: {gpus_per_run: 4, precision: bf16-mixed, time_per_run: "24:00:00"}

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
"""

from __future__ import annotations

import os
import re
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from fl_lightning.config import FabricArgs
from fl_lightning.errors import ConfigError

if TYPE_CHECKING:
    from fl_lightning.experiments.plan import Plan
    from fl_lightning.experiments.resolve import ResolvedPoint

KEYS = ("gpus_per_run", "precision", "time_per_run")
PRECISIONS = typing.get_args(typing.get_type_hints(FabricArgs)["precision"])
GPU_ACCELERATORS = ("gpu", "cuda")
_SLURM_TIME = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}")
_TIME_OPTION = re.compile(r"(--time(=.*)?|-t.*)")


@dataclass(frozen=True)
class PlanResources:
    gpus_per_run: int = 0
    precision: Optional[str] = None
    time_per_run: Optional[str] = None


def read_resources(raw) -> PlanResources:
    """A plan's `resources:` mapping checked; every problem names its key."""
    if raw is None:
        return PlanResources()
    if not isinstance(raw, dict):
        raise ConfigError("plan.resources", f"a mapping of {', '.join(KEYS)}", raw)
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ConfigError("plan.resources", f"only the keys {', '.join(KEYS)}", unknown)
    gpus = raw.get("gpus_per_run", 0)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise ConfigError("plan.resources.gpus_per_run", "an integer >= 0 (GPUs, one rank each, of every run)", gpus)
    precision = raw.get("precision")
    if precision is not None and precision not in PRECISIONS:
        raise ConfigError("plan.resources.precision", f"one of {', '.join(PRECISIONS)}", precision)
    time = raw.get("time_per_run")
    if time is not None and not (isinstance(time, str) and _SLURM_TIME.fullmatch(time)):
        raise ConfigError("plan.resources.time_per_run", 'a SLURM time limit as a quoted string ("24:00:00", '
                          '"1-12:00:00", "90"; unquoted, YAML reads 24:00:00 as a number)', time)
    return PlanResources(gpus_per_run=gpus, precision=precision, time_per_run=time)


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
    from fl_lightning.experiments.resolve import PlanRefused, describe_point

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


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else every one torch sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    import torch

    return [str(gpu) for gpu in range(torch.cuda.device_count())]
