"""Paired differences between two methods over seeds, with a 95% confidence interval.

The runs of one seed share the partition, the clients sampled each round and their batch order, so
a method's gain over a baseline is measured seed by seed: d_s = value_s - baseline_s. The interval
is Student's t for the mean of the d_s, mean(d) ± t(0.975, n - 1) sd(d) / sqrt(n), with sd the
sample standard deviation (ddof = 1). Fewer than MIN_PAIRS pairs give the mean alone: with two, the
interval's t is 12.7 and its width says nothing a reader could use.

t's quantiles come from a table (exact to the digits given, as any statistics text prints them)
for 1 to 30 degrees of freedom, and from the Cornish-Fisher expansion beyond, which is within 1e-4
of the exact value there: no SciPy, and no random draws (a bootstrap would need a seed, and with 3
to 10 seeds it resamples too few values to be trusted).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional

MIN_PAIRS = 3
CONFIDENCE = 0.95

T_975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
"""t(0.975, df) for df = 1 .. 30."""
Z_975 = 1.959964


def t_quantile_975(degrees_of_freedom: int) -> float:
    """The 0.975 quantile of Student's t with this many degrees of freedom (>= 1)."""
    if degrees_of_freedom < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {degrees_of_freedom}")
    if degrees_of_freedom <= len(T_975):
        return T_975[degrees_of_freedom - 1]
    z, n = Z_975, degrees_of_freedom
    return (z + (z ** 3 + z) / (4 * n) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * n ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * n ** 3))


@dataclass
class PairedDifference:
    """A method's values minus the baseline's, seed by seed."""

    differences: list[float]
    seeds: list[int]
    """The seeds both have, in order."""
    unpaired: list[int]
    """Seeds that only one of the two has (left out of the differences)."""

    @property
    def n(self) -> int:
        return len(self.differences)

    @property
    def mean(self) -> Optional[float]:
        return statistics.fmean(self.differences) if self.differences else None

    @property
    def interval(self) -> Optional[tuple[float, float]]:
        """The 95% confidence interval of the mean difference; None below MIN_PAIRS pairs."""
        if self.n < MIN_PAIRS:
            return None
        half = t_quantile_975(self.n - 1) * statistics.stdev(self.differences) / math.sqrt(self.n)
        return self.mean - half, self.mean + half

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly above or below 0 (False without an interval)."""
        interval = self.interval
        return interval is not None and (interval[0] > 0 or interval[1] < 0)


def paired_difference(values: dict[int, float], baseline: dict[int, float]) -> PairedDifference:
    """`values` minus `baseline` (each seed -> a run's value) over the seeds both have."""
    seeds = sorted(values.keys() & baseline.keys())
    return PairedDifference(differences=[values[s] - baseline[s] for s in seeds], seeds=seeds,
                            unpaired=sorted(values.keys() ^ baseline.keys()))


@dataclass
class PairedRatio:
    """A method's costs over the baseline's, seed by seed (`table --target --baseline`): costs are compared
    as ratios, whose spread is multiplicative, so the interval is Student's on the log scale,
    exp(mean(log r) ± t(0.975, n - 1) sd(log r) / sqrt(n)), and the ratio shown is the geometric mean
    exp(mean(log r))."""

    log: PairedDifference
    """log(cost) - log(baseline's cost) over the seeds whose runs both reached the target."""

    @property
    def n(self) -> int:
        return self.log.n

    @property
    def seeds(self) -> list[int]:
        return self.log.seeds

    @property
    def unpaired(self) -> list[int]:
        return self.log.unpaired

    @property
    def mean(self) -> Optional[float]:
        return None if self.log.mean is None else math.exp(self.log.mean)

    @property
    def interval(self) -> Optional[tuple[float, float]]:
        interval = self.log.interval
        return None if interval is None else (math.exp(interval[0]), math.exp(interval[1]))

    @property
    def excludes_zero(self) -> bool:
        """Whether the log ratio's interval excludes 0: the ratio's excludes 1 (no difference)."""
        return self.log.excludes_zero


def paired_ratio(costs: dict[int, float], baseline: dict[int, float]) -> PairedRatio:
    """`costs` over `baseline` (each seed -> a run's cost, > 0) over the seeds both have."""
    return PairedRatio(paired_difference({seed: math.log(cost) for seed, cost in costs.items()},
                                         {seed: math.log(cost) for seed, cost in baseline.items()}))
