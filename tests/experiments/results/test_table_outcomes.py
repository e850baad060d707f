"""What becomes of a run a table expects (fl_lightning.experiments.results.table_outcomes): `judge` on run
folders written here by hand, one for each way a run can stand (not started, rows lost, other
settings, unfinished, stopped early, finished), and the notes under the table that the verdicts
come to (`Outcomes`)."""

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hand_written_runs import write_checkpoint

from fl_lightning.experiments.results.table_outcomes import (
    NOTES,
    Note,
    Outcome,
    Outcomes,
    Verdict,
    judge,
)
from fl_lightning.experiments.results.table_sources import Entry
from fl_lightning.run_logging import MetricsLog

ROUNDS = 4
CONFIG = {"algorithm": {"class_path": "fl_lightning.algorithms.fedavg.FedAvg", "init_args": {}},
          "data": {"alpha": 0.5}, "federation": {"rounds": ROUNDS}, "seed": 0}


def write_run(folder: Path, evaluations: dict[int, dict], rounds_done: int, config: dict = CONFIG) -> None:
    """A run folder as `fit` leaves it: config.yaml and one row per round done, with the metrics of
    `evaluations` (round -> metrics) on the rounds they were logged."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    log = MetricsLog(folder, history=[])
    for round_index in range(1, rounds_done + 1):
        log.append({"round": round_index, "train_loss": 1.0 / round_index, "round_seconds": 0.1,
                    **evaluations.get(round_index, {})})


def entry(path: Path, config: dict = None, method: str = "FedAvg", seed: int = 0) -> Entry:
    """A run a table expects; with `config`, a plan's grid point whose settings are `config`."""
    expected = Entry(method, "alpha-0.5", seed, path)
    if config is not None:
        # The point's settings as the plan would resolve them, given here instead of resolved.
        expected.point = SimpleNamespace(waiting=False)
        expected.config = config
    return expected


ACCURACIES = {2: {"test_accuracy": 0.5, "test_loss": 1.2}, 4: {"test_accuracy": 0.7, "test_loss": 0.9}}


# judge


def test_a_finished_run_is_counted_at_its_final_value(tmp_path):
    write_run(tmp_path / "run", ACCURACIES, ROUNDS)
    verdict = judge(entry(tmp_path / "run", CONFIG), "test_accuracy", "final", include_partial=False)
    assert verdict.outcome == Outcome.COUNTED
    assert verdict.value == pytest.approx(0.7)
    assert verdict.points == [(2, 0.5), (4, 0.7)]
    assert (verdict.unfinished, verdict.under_way, verdict.on_validation) == (None, False, None)
    assert verdict.run.path == tmp_path / "run"


def test_the_value_at_last_k_is_the_mean_of_the_last_k_evaluations(tmp_path):
    write_run(tmp_path / "run", {1: {"test_loss": 3.0}, 2: {"test_loss": 2.0}, 3: {"test_loss": 1.5},
                                 4: {"test_loss": 1.0}}, ROUNDS)
    verdict = judge(entry(tmp_path / "run", CONFIG), "test_loss", "last:3", include_partial=False)
    assert verdict.value == pytest.approx((2.0 + 1.5 + 1.0) / 3)


def test_a_waiting_point_is_neither_read_nor_counted(tmp_path):
    waiting = Entry("FedAvg", "alpha-0.5", 0, tmp_path / "never_read", point=SimpleNamespace(waiting=True))
    verdict = judge(waiting, "test_accuracy", "final", include_partial=True)
    assert verdict.outcome == Outcome.WAITING and verdict.run is None and verdict.value is None


def test_a_run_without_rows_or_checkpoint_is_not_started(tmp_path):
    verdict = judge(entry(tmp_path / "absent", CONFIG), "test_accuracy", "final", include_partial=True)
    assert verdict.outcome == Outcome.NOT_STARTED and verdict.detail is None


def test_a_run_with_a_checkpoint_but_no_rows_names_the_checkpoints_round(tmp_path):
    # What a kill between a checkpoint and the log leaves: rows lost, the training not.
    write_run(tmp_path / "run", ACCURACIES, rounds_done=0)
    write_checkpoint(tmp_path / "run", 3, CONFIG)
    verdict = judge(entry(tmp_path / "run", CONFIG), "test_accuracy", "final", include_partial=True)
    assert verdict.outcome == Outcome.WITHOUT_ROWS and verdict.detail == 3


def test_a_run_made_with_other_settings_is_not_counted_and_says_which(tmp_path):
    write_run(tmp_path / "run", ACCURACIES, ROUNDS)
    point = copy.deepcopy(CONFIG)
    point["data"]["alpha"] = 0.1
    verdict = judge(entry(tmp_path / "run", point), "test_accuracy", "final", include_partial=True)
    assert verdict.outcome == Outcome.OTHER_SETTINGS
    assert verdict.detail == "data.alpha 0.5 -> 0.1 (config.yaml)"
    assert verdict.value is None


def test_a_run_that_logged_rounds_past_the_plans_is_another_experiment(tmp_path):
    # More rounds are a safe change for a resume, but a table of 3 rounds cannot count a run of 4.
    write_run(tmp_path / "run", ACCURACIES, ROUNDS)
    point = copy.deepcopy(CONFIG)
    point["federation"]["rounds"] = 3
    verdict = judge(entry(tmp_path / "run", point), "test_accuracy", "final", include_partial=True)
    assert verdict.outcome == Outcome.OTHER_SETTINGS
    assert verdict.detail == "federation.rounds: it logged round 4, past the 3 of the plan"


def test_an_unfinished_run_is_left_out_unless_partial_runs_are_asked_for(tmp_path):
    write_run(tmp_path / "run", ACCURACIES, rounds_done=3)
    left_out = judge(entry(tmp_path / "run", CONFIG), "test_accuracy", "final", include_partial=False)
    assert left_out.outcome == Outcome.EXCLUDED and left_out.value is None
    counted = judge(entry(tmp_path / "run", CONFIG), "test_accuracy", "final", include_partial=True)
    assert counted.outcome == Outcome.COUNTED
    assert (counted.unfinished, counted.under_way) == ("partial", True)
    assert counted.value == pytest.approx(0.5)  # its last evaluation so far


def test_an_early_stopped_run_counts_as_finished_at_its_last_round(tmp_path):
    write_run(tmp_path / "run", ACCURACIES, rounds_done=2)
    write_checkpoint(tmp_path / "run", 2, CONFIG, final_stop="EarlyStopping: test_accuracy did not improve")
    verdict = judge(entry(tmp_path / "run", CONFIG), "test_accuracy", "final", include_partial=False)
    assert verdict.outcome == Outcome.COUNTED
    assert (verdict.unfinished, verdict.under_way) == ("early", False)
    assert verdict.value == pytest.approx(0.5)


def test_a_checkpoint_without_a_final_stop_does_not_make_a_short_run_finished(tmp_path):
    # A row count alone cannot tell an early stop from a kill: only the checkpoint's word can.
    write_run(tmp_path / "run", ACCURACIES, rounds_done=2)
    write_checkpoint(tmp_path / "run", 2, CONFIG)
    verdict = judge(entry(tmp_path / "run", CONFIG), "test_accuracy", "final", include_partial=False)
    assert verdict.outcome == Outcome.EXCLUDED


def test_a_partial_run_without_an_evaluation_yet_is_counted_without_a_value(tmp_path):
    write_run(tmp_path / "run", ACCURACIES, rounds_done=1)
    verdict = judge(entry(tmp_path / "run", CONFIG), "test_accuracy", "final", include_partial=True)
    assert verdict.outcome == Outcome.COUNTED and verdict.value is None and verdict.under_way


def test_without_a_plan_the_rounds_are_config_yamls(tmp_path):
    write_run(tmp_path / "done", ACCURACIES, ROUNDS)
    write_run(tmp_path / "short", ACCURACIES, rounds_done=3)
    assert judge(entry(tmp_path / "done"), "test_accuracy", "final", False).outcome == Outcome.COUNTED
    assert judge(entry(tmp_path / "short"), "test_accuracy", "final", False).outcome == Outcome.EXCLUDED


def test_a_run_whose_rounds_are_unknown_is_never_taken_as_finished(tmp_path):
    folder = tmp_path / "run"
    write_run(folder, ACCURACIES, ROUNDS)
    (folder / "config.yaml").unlink()
    assert judge(entry(folder), "test_accuracy", "final", include_partial=False).outcome == Outcome.EXCLUDED
    verdict = judge(entry(folder), "test_accuracy", "final", include_partial=True)
    assert (verdict.outcome, verdict.unfinished, verdict.under_way) == (Outcome.COUNTED, "partial", True)


def test_the_best_of_a_test_metric_is_taken_at_the_best_validation_round(tmp_path):
    write_run(tmp_path / "run", {2: {"test_accuracy": 0.60, "val_accuracy": 0.70},
                                 4: {"test_accuracy": 0.65, "val_accuracy": 0.68}}, ROUNDS)
    verdict = judge(entry(tmp_path / "run", CONFIG), "test_accuracy", "best", include_partial=False)
    assert verdict.value == pytest.approx(0.60) and verdict.on_validation is True


def test_without_a_validation_split_the_best_is_chosen_on_the_test_set_and_said_so(tmp_path):
    write_run(tmp_path / "run", {2: {"test_loss": 0.8}, 4: {"test_loss": 0.9}}, ROUNDS)
    verdict = judge(entry(tmp_path / "run", CONFIG), "test_loss", "best", include_partial=False)
    assert verdict.value == pytest.approx(0.8) and verdict.on_validation is False


def test_the_best_of_a_metric_other_than_a_tests_is_its_own_best(tmp_path):
    write_run(tmp_path / "run", ACCURACIES, ROUNDS)
    verdict = judge(entry(tmp_path / "run", CONFIG), "train_loss", "best", include_partial=False)
    assert verdict.value == pytest.approx(1.0 / ROUNDS) and verdict.on_validation is None


def test_a_torn_last_line_leaves_the_rows_before_it_to_be_judged(tmp_path):
    write_run(tmp_path / "run", ACCURACIES, ROUNDS)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as handle:
        handle.write('{"round": 5, "tr')
    verdict = judge(entry(tmp_path / "run", CONFIG), "test_accuracy", "final", include_partial=False)
    assert verdict.outcome == Outcome.COUNTED and verdict.value == pytest.approx(0.7) and verdict.run.torn_line


# Outcomes


def judged(tmp_path: Path) -> dict[str, Verdict]:
    """One run of each kind, judged for a table of test_accuracy at its best."""
    runs = {}
    write_run(tmp_path / "finished", {2: {"test_accuracy": 0.5}, 4: {"test_accuracy": 0.7}}, ROUNDS)
    write_run(tmp_path / "partial", ACCURACIES, 3)
    write_run(tmp_path / "early", ACCURACIES, 2)
    write_checkpoint(tmp_path / "early", 2, CONFIG, final_stop="EarlyStopping")
    write_run(tmp_path / "pending", {}, 1)
    write_run(tmp_path / "empty", {}, ROUNDS)
    write_run(tmp_path / "torn", ACCURACIES, ROUNDS)
    with open(tmp_path / "torn" / "metrics.jsonl", "a") as handle:
        handle.write("{")
    write_run(tmp_path / "lost", {}, 0)
    write_checkpoint(tmp_path / "lost", 3, CONFIG)
    other = copy.deepcopy(CONFIG)
    other["data"]["alpha"] = 0.1
    write_run(tmp_path / "other", ACCURACIES, ROUNDS)
    for seed, name in enumerate(["finished", "partial", "early", "pending", "empty", "torn", "lost", "other",
                                 "absent"]):
        runs[name] = judge(entry(tmp_path / name, other if name == "other" else CONFIG, seed=seed),
                           "test_accuracy", "best", include_partial=name in ("partial", "pending"))
    runs["waiting"] = Verdict(Entry("Tuned", "alpha-0.1", 9, tmp_path / "waiting"), Outcome.WAITING)
    return runs


def test_each_verdict_goes_to_its_note(tmp_path):
    verdicts = judged(tmp_path)
    outcomes = Outcomes.of(list(verdicts.values()))
    entries = {name: verdict.entry for name, verdict in verdicts.items()}
    # A run counted under way is partial, whether or not it has a value yet.
    assert outcomes.runs(Note.PARTIAL) == [entries[name] for name in ("partial", "pending")]
    assert outcomes.runs(Note.EARLY) == [entries["early"]]
    assert outcomes.runs(Note.PENDING) == [entries["pending"]]
    assert outcomes.runs(Note.EMPTY) == [entries["empty"]]
    assert outcomes.runs(Note.TORN) == [entries["torn"]]
    assert [(listed.entry, dict(listed.fields)["round"]) for listed in outcomes.listed[Note.WITHOUT_ROWS]] == [
        (entries["lost"], 3)]
    assert outcomes.shown(Note.OTHER_SETTINGS) == ["alpha-0.5/FedAvg/seed7 (data.alpha 0.5 -> 0.1 (config.yaml))"]
    assert outcomes.runs(Note.NOT_STARTED) == [entries["absent"]]
    assert outcomes.runs(Note.WAITING) == [entries["waiting"]]
    assert outcomes.runs(Note.EXCLUDED) == []
    # Every counted run with a value was chosen on the test set: none logged a validation split.
    assert outcomes.runs(Note.CHOSEN_ON_TEST) == [entries[name] for name in ("finished", "partial", "early", "torn")]
    assert outcomes.runs(Note.CHOSEN_ON_VALIDATION) == []


def test_every_outcome_but_counted_and_every_note_has_its_words(tmp_path):
    assert set(NOTES) == set(Note)
    # A run not counted is listed under the note of its outcome.
    assert {outcome.name for outcome in Outcome} - {"COUNTED"} <= {note.name for note in Note}
    verdicts = [Verdict(Entry("FedAvg", "alpha-0.5", 0, tmp_path / "a"), Outcome.WITHOUT_ROWS, detail=2),
                Verdict(Entry("FedAvg", "alpha-0.5", 1, tmp_path / "b"), Outcome.WITHOUT_ROWS, detail=5)]
    # A note whose runs differ in another field is one note for each value of it.
    assert len(Outcomes.of(verdicts).notes("test_accuracy")) == 2


def test_the_cells_under_way_are_those_a_value_may_yet_fill(tmp_path):
    verdicts = judged(tmp_path)
    write_run(tmp_path / "excluded", ACCURACIES, 3)
    excluded = judge(entry(tmp_path / "excluded", CONFIG, method="SCAFFOLD"), "test_accuracy", "final", False)
    outcomes = Outcomes.of([*verdicts.values(), excluded])
    assert outcomes.cells_under_way() == {("FedAvg", "alpha-0.5"), ("SCAFFOLD", "alpha-0.5"), ("Tuned", "alpha-0.1")}
    assert Outcomes.of([verdicts["finished"], verdicts["empty"]]).cells_under_way() == set()


def test_the_notes_name_each_run_and_its_progress(tmp_path):
    verdicts = judged(tmp_path)
    write_run(tmp_path / "excluded", ACCURACIES, 3)
    excluded = judge(entry(tmp_path / "excluded", CONFIG, seed=11), "test_accuracy", "final", False)
    notes = Outcomes.of([*verdicts.values(), excluded]).notes("test_accuracy")
    assert ("not counted, unfinished (--include_partial true counts them): alpha-0.5/FedAvg/seed11 (round 3/4)"
            in notes)
    assert ("counted although unfinished: alpha-0.5/FedAvg/seed1 (round 3/4), alpha-0.5/FedAvg/seed3 (round 1/4)"
            in notes)
    assert ("finished early (a final stop in its checkpoint), counted at its last round: "
            "alpha-0.5/FedAvg/seed2 (round 2/4)") in notes
    assert (f"alpha-0.5/FedAvg/seed6: no metrics rows (checkpoint at round 3): resume it to rewrite them "
            f"(fl-lightning fit --config {tmp_path / 'lost' / 'config.yaml'})") in notes
    assert "pending, no test_accuracy logged yet (its evaluations are to come): alpha-0.5/FedAvg/seed3" in notes
    assert "no test_accuracy logged: alpha-0.5/FedAvg/seed4" in notes
    assert "not started: alpha-0.5/FedAvg/seed8" in notes
    assert any(note.startswith("a torn last line of metrics.jsonl left out") and note.endswith("alpha-0.5/FedAvg/seed5")
               for note in notes)
    assert any(note.endswith(": alpha-0.5/FedAvg/seed0, alpha-0.5/FedAvg/seed1, alpha-0.5/FedAvg/seed2, "
                             "alpha-0.5/FedAvg/seed5") and "selected on the test set" in note for note in notes)


def test_a_table_whose_runs_all_counted_has_no_notes(tmp_path):
    write_run(tmp_path / "run", ACCURACIES, ROUNDS)
    verdict = judge(entry(tmp_path / "run", CONFIG), "test_accuracy", "final", include_partial=False)
    assert Outcomes.of([verdict]).notes("test_accuracy") == []


def test_a_long_listing_is_cut_at_twenty_runs(tmp_path):
    verdicts = [Verdict(Entry("FedAvg", "alpha-0.5", seed, tmp_path / str(seed)), Outcome.NOT_STARTED)
                for seed in range(23)]
    (note,) = Outcomes.of(verdicts).notes("test_accuracy")
    listed = ", ".join(f"alpha-0.5/FedAvg/seed{seed}" for seed in range(20))
    assert note == f"not started: {listed} and 3 more"
