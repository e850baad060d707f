"""Paired differences and their t intervals against direct computations."""

import math

import pytest

from fl_lightning.experiments.results.statistics import T_975, paired_difference, paired_ratio, t_quantile_975


def t_probability_below(quantile: float, degrees_of_freedom: int, steps: int = 20000) -> float:
    """P(T <= quantile) for Student's t, by Simpson's rule over its density from 0."""
    nu = degrees_of_freedom
    scale = math.exp(math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2)) / math.sqrt(nu * math.pi)

    def density(t):
        return scale * (1 + t * t / nu) ** (-(nu + 1) / 2)

    width = quantile / steps
    total = density(0) + density(quantile) + sum((4 if i % 2 else 2) * density(i * width) for i in range(1, steps))
    return 0.5 + total * width / 3


@pytest.mark.parametrize("degrees_of_freedom", [*range(1, len(T_975) + 1), 31, 40, 60, 120, 500])
def test_the_quantiles_are_students(degrees_of_freedom):
    probability = t_probability_below(t_quantile_975(degrees_of_freedom), degrees_of_freedom)
    assert probability == pytest.approx(0.975, abs=1e-5)


def test_the_integration_is_the_closed_form_and_tells_t_from_the_normal():
    # With 2 degrees of freedom P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2)).
    for t in (0.5, 1.96, 4.3):
        assert t_probability_below(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-9)
    assert t_probability_below(1.96, 2) < 0.91  # the normal's 0.975 quantile is far from t's at 2 df


def test_a_paired_difference_and_its_interval():
    # FedAvg + CONST minus FedAvg, seed by seed: +2.8, -1.5, +2.5.
    values = {0: 52.1, 1: 50.0, 2: 54.0}
    baseline = {0: 49.3, 1: 51.5, 2: 51.5}
    paired = paired_difference(values, baseline)
    differences = [2.8, -1.5, 2.5]
    assert paired.differences == pytest.approx(differences)
    mean = sum(differences) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / 2)
    half = 4.3027 * sd / math.sqrt(3)
    assert paired.mean == pytest.approx(mean)
    assert paired.interval == pytest.approx((mean - half, mean + half))
    assert not paired.excludes_zero  # -4.1 .. 6.6


def test_an_interval_that_excludes_zero():
    paired = paired_difference({0: 3.0, 1: 3.2, 2: 2.9, 3: 3.1}, {0: 1.0, 1: 1.1, 2: 1.0, 3: 1.2})
    low, high = paired.interval
    assert 0 < low < paired.mean < high
    assert paired.excludes_zero
    assert paired_difference({0: 1.0, 1: 1.1, 2: 1.0}, {0: 3.0, 1: 3.2, 2: 2.9}).excludes_zero  # below 0


def test_fewer_than_three_pairs_give_no_interval_and_unpaired_seeds_are_named():
    paired = paired_difference({0: 50.0, 1: 52.0, 5: 40.0}, {0: 49.0, 1: 50.0, 2: 45.0})
    assert paired.seeds == [0, 1] and paired.unpaired == [2, 5]
    assert paired.mean == pytest.approx(1.5)
    assert paired.interval is None and not paired.excludes_zero
    assert paired_difference({}, {0: 1.0}).mean is None


def test_a_paired_ratio_is_the_exponentiated_interval_of_the_log_ratios():
    costs, baseline = {0: 200.0, 1: 320.0, 2: 440.0, 7: 90.0}, {0: 400.0, 1: 440.0, 2: 480.0}
    ratio = paired_ratio(costs, baseline)
    logs = [math.log(200 / 400), math.log(320 / 440), math.log(440 / 480)]
    mean = sum(logs) / 3
    half = 4.3027 * math.sqrt(sum((value - mean) ** 2 for value in logs) / 2) / math.sqrt(3)
    assert ratio.n == 3 and ratio.seeds == [0, 1, 2] and ratio.unpaired == [7]
    assert ratio.mean == pytest.approx(math.exp(mean))  # the geometric mean of the ratios
    assert ratio.interval == pytest.approx((math.exp(mean - half), math.exp(mean + half)))
    assert ratio.excludes_zero is (math.exp(mean + half) < 1)  # excludes a ratio of 1
    assert paired_ratio({0: 1.0, 1: 1.1, 2: 1.0}, {0: 3.0, 1: 3.2, 2: 2.9}).excludes_zero
