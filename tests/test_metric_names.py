"""The metrics' names and the one rule of a run's best value: a test metric at the earliest evaluation of its
best validation counterpart, else its own best (losses minimised, accuracies maximised), and how that is said."""

from fl_lightning.metric_names import (
    Best,
    best_keys,
    best_round,
    best_value,
    final_key,
    lower_is_better,
    selection_note,
    validation_counterpart,
)
from fl_lightning.run_logging import run_summary


def test_the_best_is_the_test_metric_at_the_earliest_round_of_the_best_validation_value():
    history = [{"round": 1, "val_accuracy": 0.5, "test_accuracy": 0.40, "val_loss": 0.9, "test_loss": 1.0},
               {"round": 2, "val_accuracy": 0.7, "test_accuracy": 0.55, "val_loss": 0.6, "test_loss": 0.8},
               {"round": 3, "train_loss": 0.1},
               {"round": 4, "val_accuracy": 0.7, "test_accuracy": 0.60, "val_loss": 0.6, "test_loss": 0.7},
               {"round": 5, "val_accuracy": 0.6, "test_accuracy": 0.65, "val_loss": 0.7, "test_loss": 0.5}]
    # The earliest of the tied best validation rounds, never the test set's own best (round 5).
    best = best_round(history, "test_accuracy")
    assert best == Best("test_accuracy", round=2, value=0.55, selected_on="val_accuracy")
    assert best.on_validation
    assert best.describe() == "round 2, at the best val_accuracy"
    assert best_round(history, "test_loss") == Best("test_loss", round=2, value=0.8, selected_on="val_loss")
    assert best_round(history, "val_accuracy") == Best("val_accuracy", round=2, value=0.7, selected_on="val_accuracy")
    assert run_summary(history) == {"final_test_accuracy": 0.65, "best_test_accuracy": 0.55,
                                    "best_test_accuracy_round": 2, "best_test_accuracy_selected_on": "val_accuracy",
                                    "best_val_accuracy": 0.7, "rounds_done": 5}
    # Without a split: the test set's own best, which says so.
    without = [{key: value for key, value in row.items() if not key.startswith("val_")} for row in history]
    assert best_round(without, "test_accuracy").describe() == "round 5, selected on the test set: no validation split"
    assert run_summary(without)["best_test_accuracy_selected_on"] == "test_accuracy"
    assert run_summary([{"round": 1, "train_loss": 0.4}]) == {}


def test_losses_are_minimised_and_every_other_metric_maximised():
    assert [lower_is_better(name) for name in ("test_loss", "train_loss", "Val_Loss", "test_accuracy",
                                               "client_val_accuracy_min")] == [True, True, True, False, False]
    assert best_value([0.3, 0.1, 0.2], "val_loss") == 0.1
    assert best_value([0.3, 0.1, 0.2], "val_accuracy") == 0.3


def test_a_test_metric_is_chosen_by_its_validation_counterpart_and_others_by_themselves():
    assert validation_counterpart("test_accuracy") == "val_accuracy"
    assert validation_counterpart("test_loss") == "val_loss"
    assert validation_counterpart("val_accuracy") is None
    assert validation_counterpart("client_val_accuracy_min") is None
    assert final_key("test_accuracy") == "final_test_accuracy"
    assert best_keys("test_loss") == ("best_test_loss", "best_test_loss_round", "best_test_loss_selected_on")


def test_a_metric_never_logged_or_never_logged_with_its_selector_has_no_best():
    assert best_round([{"round": 1, "train_loss": 0.4}], "test_accuracy") is None
    # Evaluations that logged the test metric but not its counterpart, in a run that logged the
    # counterpart elsewhere, cannot be chosen: the test set would choose them.
    history = [{"round": 1, "test_accuracy": 0.9}, {"round": 2, "val_accuracy": 0.5}]
    assert best_round(history, "test_accuracy") is None


def test_the_note_under_a_table_says_which_set_chose_the_round():
    assert "validation split" in selection_note("test_accuracy", on_validation=True)
    assert "test set chooses nothing" in selection_note("test_accuracy", on_validation=True)
    assert "optimistic" in selection_note("test_accuracy", on_validation=False)
    assert Best("test_accuracy", 3, 0.5, "test_accuracy").summary() == {
        "best_test_accuracy": 0.5, "best_test_accuracy_round": 3, "best_test_accuracy_selected_on": "test_accuracy"}
    assert Best("val_loss", 2, 0.4, "val_loss").describe() == "round 2"
