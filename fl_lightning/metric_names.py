"""The metrics a run logs, which way each improves, and the one rule of a run's best value.

A test metric `test_X` (test_accuracy, test_loss) has a validation counterpart `val_X`, logged when
the run holds out a validation split (data.validation). The best of a test metric is its value at
the evaluation of the best `val_X` (the earliest on a tie), so that the test set chooses nothing;
a run without a split has no `val_X`, and its best is then the test metric's own best, selected
on the test set. The best of any other metric (val_accuracy, train_loss, client_val_accuracy_min)
is its own best. Losses are minimised, every other metric (accuracies) maximised.

`fit`'s last line, the W&B summary, `fl-lightning compare`, `table --at best` and the dashboard
all take a best through `best_round`, and say which way it was selected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TEST_PREFIX, VALIDATION_PREFIX = "test_", "val_"
TEST_ACCURACY, TEST_LOSS = "test_accuracy", "test_loss"
VAL_ACCURACY, VAL_LOSS = "val_accuracy", "val_loss"
CLIENT_VAL_ACCURACY_MEAN = "client_val_accuracy_mean"
CLIENT_VAL_ACCURACY_STD = "client_val_accuracy_std"
CLIENT_VAL_ACCURACY_MIN = "client_val_accuracy_min"
CLIENT_VAL_ACCURACY_P10 = "client_val_accuracy_p10"
"""The global model's accuracy on each client's held-out samples, summarised over the clients
(data.per_client_eval): mean, std (ddof = 0), minimum and 10th percentile."""
COST_SAMPLES, COST_GRAD_EVALS, COST_FORWARD_PASSES = "cost_samples", "cost_grad_evals", "cost_forward_passes"
COST_UPLOAD_BYTES, COST_DOWNLOAD_BYTES = "cost_upload_bytes", "cost_download_bytes"
COST_CLIENT_SECONDS = "cost_client_seconds"
COST_COUNTERS = (COST_SAMPLES, COST_GRAD_EVALS, COST_FORWARD_PASSES, COST_UPLOAD_BYTES, COST_DOWNLOAD_BYTES,
                 COST_CLIENT_SECONDS)
"""What a run spent up to the end of a round, logged with every round (`fl_lightning.federation.costs`)."""
CLIENTS_ONLINE, CLIENTS_DRAWN = "clients_online", "clients_drawn"
CLIENTS_REPORTED, CLIENTS_DROPPED = "clients_reported", "clients_dropped"
STEPS_MEAN, STEPS_MIN = "steps_mean", "steps_min"
PARTICIPATION_METRICS = (CLIENTS_ONLINE, CLIENTS_DRAWN, CLIENTS_REPORTED, CLIENTS_DROPPED, STEPS_MEAN, STEPS_MIN)
"""Who took part in a round and the local steps the reporting clients did, logged with every round
(`federation.participation`, `dropout`, `stragglers`)."""


def lower_is_better(metric: str) -> bool:
    """Losses are minimised; every other metric (accuracies) is maximised."""
    return "loss" in metric.lower()


def best_value(values: list[float], metric: str) -> float:
    """The best of `values` of `metric`: the minimum of a loss, else the maximum."""
    return min(values) if lower_is_better(metric) else max(values)


def is_test_metric(metric: str) -> bool:
    return metric.startswith(TEST_PREFIX)


def validation_counterpart(metric: str) -> Optional[str]:
    """What the best round of `metric` is chosen by: val_X for a test metric test_X, None for a
    metric that is not the test set's (it is its own best)."""
    return VALIDATION_PREFIX + metric.removeprefix(TEST_PREFIX) if is_test_metric(metric) else None


def final_key(metric: str) -> str:
    """The name of a run's last logged value of `metric` (a W&B summary key, a `compare` column)."""
    return f"final_{metric}"


def best_keys(metric: str) -> tuple[str, str, str]:
    """The names of a run's best value of `metric`, its round and the metric that selected the round
    (W&B summary keys, `compare` columns)."""
    return f"best_{metric}", f"best_{metric}_round", f"best_{metric}_selected_on"


def selection(metric: str, on_validation: bool) -> str:
    """How a best value of `metric` (a test metric) was selected, in a few words."""
    if on_validation:
        return f"at the best {validation_counterpart(metric)}"
    return "selected on the test set: no validation split"


def selection_note(metric: str, on_validation: bool) -> str:
    """How the best values of test metric `metric` were selected, in a sentence for the notes under a
    table (followed by the runs it applies to)."""
    counterpart = validation_counterpart(metric)
    if on_validation:
        return (f"best: each run's {metric} at the evaluation of its best {counterpart} (model selection on the "
                "validation split, data.validation; the test set chooses nothing)")
    return (f"best: selected on the test set itself, the best {metric} over the evaluations (no {counterpart} "
            "logged: no validation split, data.validation), an optimistic number")


@dataclass(frozen=True)
class Best:
    """A run's best value of `metric`, the round it was taken at and the metric that chose the round."""

    metric: str
    round: int
    value: float
    selected_on: str
    """val_X for a test metric test_X of a run with a validation split, else `metric` itself."""

    @property
    def on_validation(self) -> bool:
        return self.selected_on != self.metric

    def describe(self) -> str:
        """`round 2, at the best val_accuracy`, `round 3, selected on the test set: no validation split`,
        or `round 3` for a metric that is its own best."""
        how = f", {selection(self.metric, self.on_validation)}" if is_test_metric(self.metric) else ""
        return f"round {self.round}{how}"

    def summary(self) -> dict:
        """The best as `best_keys` name it."""
        return dict(zip(best_keys(self.metric), (self.value, self.round, self.selected_on)))


def best_round(history: list[dict], metric: str) -> Optional[Best]:
    """The best of `metric` over a run's metrics rows (each with its `round`): for a test metric of a
    run that logged its validation counterpart, the metric at the evaluation of the best counterpart,
    among the evaluations that logged both; otherwise the metric's own best. The earliest round on a
    tie. None when no row has a value to choose (the metric was never logged)."""
    selector = validation_counterpart(metric)
    if selector is None or all(row.get(selector) is None for row in history):
        selector = metric  # not a test metric, or a run without a validation split: its own best
    rows = [row for row in history if row.get(metric) is not None and row.get(selector) is not None]
    if not rows:
        return None
    best = best_value([row[selector] for row in rows], selector)
    chosen = next(row for row in rows if row[selector] == best)
    return Best(metric=metric, round=chosen["round"], value=chosen[metric], selected_on=selector)
