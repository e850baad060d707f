"""A plan's `resources:` as read from the plan file (`PlanResources`): what each run of the plan asks for.
How a sweep honours it is fl_lightning.experiments.sweeps.resources."""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from typing import Optional

from fl_lightning.config import FabricArgs
from fl_lightning.errors import ConfigError

KEYS = ("gpus_per_run", "precision", "time_per_run", "cpus_per_run")
PRECISIONS = typing.get_args(typing.get_type_hints(FabricArgs)["precision"])
_SLURM_TIME = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}")


@dataclass(frozen=True)
class PlanResources:
    gpus_per_run: int = 0
    precision: Optional[str] = None
    time_per_run: Optional[str] = None
    cpus_per_run: Optional[int] = None


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
    if not _is_count(gpus, 0):
        raise ConfigError("plan.resources.gpus_per_run", "an integer >= 0 (GPUs, one rank each, of every run)", gpus)
    cpus = raw.get("cpus_per_run")
    if cpus is not None and not _is_count(cpus, 1):
        raise ConfigError("plan.resources.cpus_per_run", "an integer >= 1 (CPUs of every array task)", cpus)
    precision = raw.get("precision")
    if precision is not None and precision not in PRECISIONS:
        raise ConfigError("plan.resources.precision", f"one of {', '.join(PRECISIONS)}", precision)
    time = raw.get("time_per_run")
    if time is not None and not (isinstance(time, str) and _SLURM_TIME.fullmatch(time)):
        raise ConfigError("plan.resources.time_per_run", 'a SLURM time limit as a quoted string ("24:00:00", '
                          '"1-12:00:00", "90"; unquoted, YAML reads 24:00:00 as a number)', time)
    return PlanResources(gpus_per_run=gpus, precision=precision, time_per_run=time, cpus_per_run=cpus)


def _is_count(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least

