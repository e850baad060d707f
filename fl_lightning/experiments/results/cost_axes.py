"""The cost axes of `table --x` and `compare --x`, and the cost to reach a target (`table --target`).

A run's rows carry cumulative cost counters (fl_lightning.experiments.runs.BUDGET_AXES); an axis is one
of them, or rounds. `--target test_accuracy=0.5 --x grad_evals` makes each run's value what it had spent
on the axis by its first evaluation at or above the target (at or below for a loss): the axis value of
that evaluation's row. A run whose evaluations never meet it has no cost, and its table cell counts it
as not reached, never leaves it out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.runs import BUDGET_AXES, RunFolder
from fl_lightning.metric_names import lower_is_better

AXIS_UNITS = {"rounds": "rounds", "samples": "training examples", "grad_evals": "gradient evaluations",
              "upload_bytes": "bytes sent up", "bytes": "bytes sent up and down", "seconds": "client seconds"}
"""How a plot's axis label and a caption say each axis's unit."""
TARGET_FORM = "METRIC=VALUE, a metric and the value to reach (test_accuracy=0.5, a fraction; test_loss=1.2)"


def parse_axis(x: str) -> str:
    """The axis `x` names (BUDGET_AXES), refused naming --x otherwise."""
    if x not in BUDGET_AXES:
        raise ConfigError("x", f"an axis of {', '.join(BUDGET_AXES)}", x)
    return x


def axis_label(axis: str) -> str:
    """A plot's x label: `grad_evals (gradient evaluations)`, `round` for rounds."""
    return "round" if axis == "rounds" else f"{axis} ({AXIS_UNITS[axis]})"


@dataclass(frozen=True)
class Target:
    """`--target METRIC=VALUE --x AXIS`: what each run spent on `axis` to reach `threshold` of `metric`."""

    metric: str
    threshold: float
    axis: str

    @property
    def reached_by(self) -> str:
        return "at or below" if lower_is_better(self.metric) else "at or above"

    @property
    def options(self) -> str:
        return f"--target {self.metric}={self.threshold:g} --x {self.axis}"

    @property
    def goal(self) -> str:
        """`test_accuracy ≥ 0.5`."""
        return f"{self.metric} {'≤' if lower_is_better(self.metric) else '≥'} {self.threshold:g}"

    def cost(self, run: RunFolder) -> Optional[float]:
        """The axis value of the run's first evaluation that meets the target; None where none does."""
        lower = lower_is_better(self.metric)
        for spent, value in run.points_on(self.axis, self.metric):
            if (value <= self.threshold) if lower else (value >= self.threshold):
                return spent
        return None

    def missed(self, run: RunFolder) -> bool:
        """Whether the run has evaluations on the axis and none of them meets the target."""
        return bool(run.points_on(self.axis, self.metric)) and self.cost(run) is None


def parse_target(target: str, x: Optional[str], metric: Optional[str], at: str, reference: object) -> Target:
    """`--target` and its `--x` (rounds by default), refused before any run is read: a target of another
    form, a --metric other than its own, an --at (the cost has no round to be taken at) or a --reference
    (the papers' numbers are of the metric, not of a cost)."""
    name, is_pair, value = target.partition("=")
    try:
        threshold = float(value)
    except ValueError:
        threshold = math.nan
    if not (is_pair and name and math.isfinite(threshold)):
        raise ConfigError("target", TARGET_FORM, target)
    if metric is not None and metric != name:
        raise ConfigError("metric", f"none, or the metric of --target ({name})", metric)
    if at != "final":
        raise ConfigError("at", "no --at with --target (each run's value is its cost to reach the target)", at)
    if reference is not None:
        raise ConfigError("reference", "no reference with --target (the papers' numbers are of the metric)",
                          str(reference))
    return Target(name, threshold, parse_axis(x or "rounds"))
