"""The reader of run folders (fl_lightning.experiments.runs): a folder written here by hand as `fit`
leaves it (config.yaml, metrics.jsonl, checkpoints), read back as `RunFolder` reads it: its config,
its rows and a torn last line, its pace, its state as `--resume auto` finds it, and what makes it
another experiment than a config."""

import copy
import json
import re
from pathlib import Path

import pytest
import yaml
from hand_written_runs import write_checkpoint

from fl_lightning.checkpoint import checkpoint_dir
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.runs import (
    EVALUATION_METRICS,
    PER_CLIENT_METRICS,
    VALIDATION_METRICS,
    Pace,
    RunFolder,
    RunState,
    check_metric,
    find_runs,
    run_labels,
)
from fl_lightning.run_logging import MetricsLog

CONFIG = {"algorithm": {"class_path": "fl_lightning.algorithms.fedavg.FedAvg", "init_args": {}},
          "data": {"name": "cifar10", "alpha": 0.5},
          "federation": {"rounds": 4, "num_clients": 10, "eval_every": 2}, "seed": 0}


def write_config(folder: Path, config: dict = CONFIG) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


def row(round_index: int, **metrics) -> dict:
    return {"round": round_index, "train_loss": 1.0 / round_index, "round_seconds": 0.5, **metrics}


def write_rows(folder: Path, rows: list[dict]) -> None:
    """metrics.jsonl as the run's log writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(folder, history=[])
    for metrics in rows:
        log.append(metrics)


def with_setting(config: dict, group: str, name: str, value) -> dict:
    changed = copy.deepcopy(config)
    changed[group][name] = value
    return changed


# config.yaml


def test_the_config_and_the_rounds_planned_come_from_config_yaml(tmp_path):
    write_config(tmp_path)
    run = RunFolder(tmp_path)
    assert run.config == CONFIG
    assert run.rounds_planned == 4


def test_a_folder_without_config_yaml_has_an_empty_config_and_no_rounds_planned(tmp_path):
    run = RunFolder(tmp_path)
    assert run.config == {} and run.rounds_planned is None


def test_a_config_yaml_that_is_not_a_mapping_reads_as_empty(tmp_path):
    (tmp_path / "config.yaml").write_text("- a list\n- not settings\n")
    assert RunFolder(tmp_path).config == {}


@pytest.mark.parametrize("algorithm, constraint, method", [
    ("fl_lightning.algorithms.fedavg.FedAvg", None, "fedavg"),
    ("fl_lightning.algorithms.scaffold.SCAFFOLD", {"class_path": "fl_lightning.constraints.CONST"}, "scaffold+const"),
    # An algorithm of a module that cannot be imported here is named by its class name.
    ("some_lab.algorithms.FancyAvg", None, "FancyAvg"),
])
def test_the_method_is_named_as_fit_names_it(tmp_path, algorithm, constraint, method):
    write_config(tmp_path, {**CONFIG, "algorithm": {"class_path": algorithm}, "constraint": constraint})
    assert RunFolder(tmp_path).method == method


# metrics.jsonl


def test_the_history_is_one_row_per_round_in_order(tmp_path):
    rows = [row(1), row(2, test_accuracy=0.4), row(3), row(4, test_accuracy=0.6)]
    write_rows(tmp_path, rows)
    run = RunFolder(tmp_path)
    assert run.history == rows
    assert not run.torn_line
    assert run.rounds_done == 4


def test_a_run_without_metrics_has_no_rows_and_no_torn_line(tmp_path):
    run = RunFolder(tmp_path)
    assert run.history == [] and not run.torn_line and run.rounds_done == 0
    (tmp_path / "metrics.jsonl").write_text("")
    run = RunFolder(tmp_path)
    assert run.history == [] and not run.torn_line


def test_a_torn_last_line_is_left_out_and_flagged(tmp_path):
    write_rows(tmp_path, [row(1), row(2)])
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"round": 3, "train_lo')  # what a kill while appending leaves
    run = RunFolder(tmp_path)
    assert run.history == [row(1), row(2)]
    assert run.torn_line
    assert run.rounds_done == 2


def test_a_last_line_without_an_integer_round_counts_as_torn(tmp_path):
    # Valid JSON, but not a row: as much a partial write as a cut-off object.
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row(1)) + "\n" + '{"round": "2"}\n')
    run = RunFolder(tmp_path)
    assert run.history == [row(1)] and run.torn_line


def test_an_unreadable_line_before_the_last_is_refused_naming_the_file_and_the_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([json.dumps(row(1)), json.dumps(row(2)), "[1, 2]", json.dumps(row(4))]) + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"got '{path}, line 3'")):
        list(RunFolder(tmp_path).history)
    # The pace of such a run is unknown rather than an error: a sweep's progress only reports it.
    assert RunFolder(tmp_path).pace is None


def test_points_and_the_metrics_logged_leave_out_missing_and_null_values(tmp_path):
    # A non-finite loss is written as null.
    write_rows(tmp_path, [row(1), row(2, test_accuracy=0.5, test_loss=float("nan")), row(3),
                          row(4, test_accuracy=0.75, test_loss=0.8)])
    run = RunFolder(tmp_path)
    assert run.points("test_accuracy") == [(2, 0.5), (4, 0.75)]
    assert run.points("test_loss") == [(4, 0.8)]
    assert run.points("val_accuracy") == []
    assert run.metrics_logged() == {"train_loss", "round_seconds", "test_accuracy", "test_loss"}


def test_a_runs_value_at_final_last_k_and_best(tmp_path):
    write_rows(tmp_path, [row(1, test_accuracy=0.4, val_accuracy=0.5, test_loss=0.9),
                          row(2, test_accuracy=0.7, val_accuracy=0.9, test_loss=0.6),
                          row(3, test_accuracy=0.8, val_accuracy=0.6, test_loss=0.7)])
    run = RunFolder(tmp_path)
    assert run.value("test_accuracy", "final") == 0.8
    assert run.value("test_accuracy", "last:2") == pytest.approx((0.7 + 0.8) / 2)
    assert run.value("test_accuracy", "last:9") == pytest.approx((0.4 + 0.7 + 0.8) / 3)  # fewer than K: all
    # A test metric's best is at its validation counterpart's best round (2), not its own (3).
    assert run.value("test_accuracy", "best") == 0.7
    assert run.value("val_accuracy", "best") == 0.9
    assert run.value("test_loss", "best") == 0.6  # a loss's best is its lowest
    assert run.value("client_val_accuracy_mean", "final") is None  # before its first
    assert run.value("client_val_accuracy_mean", "best") is None
    with pytest.raises(ConfigError, match="at: expected final, best, last:K"):
        run.value("test_accuracy", "last:0")


def test_a_runs_value_at_a_budget_is_its_last_evaluation_within_it_and_none_short_of_it(tmp_path):
    """Evaluations every second round, 150 gradient evaluations and 1000 + 3000 bytes a round."""
    rows = [row(r, cost_grad_evals=150 * r, cost_upload_bytes=1000 * r, cost_download_bytes=3000 * r,
                **({"test_accuracy": r / 10} if r % 2 == 0 else {})) for r in range(1, 7)]
    write_rows(tmp_path, rows)
    run = RunFolder(tmp_path)
    for axis, per_round in (("grad_evals", 150), ("upload_bytes", 1000), ("bytes", 4000), ("rounds", 1)):
        for budget in (2 * per_round, 3.5 * per_round, 6 * per_round, 9 * per_round):
            evaluated = [r for r in (2, 4, 6) if r * per_round <= budget]
            reached = 6 * per_round >= budget
            expected = evaluated[-1] / 10 if reached else None
            assert run.value("test_accuracy", f"{axis}={budget:g}") == expected, (axis, budget)
            assert run.reaches("test_accuracy", f"{axis}={budget:g}") == reached
    assert run.value("test_accuracy", "grad_evals=100") is None  # reached, but no evaluation within it
    assert not run.reaches("test_accuracy", "samples=1")  # its rows have no cost_samples
    for at in ("flops=3", "grad_evals=0", "grad_evals=-1", "grad_evals=inf", "grad_evals=lots"):
        with pytest.raises(ConfigError, match="AXIS=BUDGET"):
            run.value("test_accuracy", at)


def test_the_metrics_to_come_follow_the_configs_evaluation_settings(tmp_path):
    write_rows(tmp_path, [row(1)])
    plain, validated, per_client = (tmp_path / name for name in ("plain", "validated", "per_client"))
    for folder, data in ((plain, {}), (validated, {"validation": 0.2}),
                         (per_client, {"validation": 0.2, "per_client_eval": True})):
        write_config(folder, {**CONFIG, "data": {**CONFIG["data"], **data}})
        write_rows(folder, [row(1)])
    assert RunFolder(plain).metrics_to_come() == set(EVALUATION_METRICS)
    assert RunFolder(validated).metrics_to_come() == {*EVALUATION_METRICS, *VALIDATION_METRICS}
    assert RunFolder(per_client).metrics_to_come() == {*EVALUATION_METRICS, *VALIDATION_METRICS,
                                                       *PER_CLIENT_METRICS}
    assert RunFolder(tmp_path).metrics_to_come() == set()  # no config: nothing is known to come


def test_a_run_that_logged_its_last_round_has_no_metrics_to_come(tmp_path):
    write_config(tmp_path)
    write_rows(tmp_path, [row(r) for r in range(1, 5)])
    assert RunFolder(tmp_path).metrics_to_come() == set()


def test_a_metric_nobody_logged_nor_will_log_is_refused(tmp_path):
    done, under_way = tmp_path / "done", tmp_path / "under_way"
    write_config(done)
    write_rows(done, [row(r) for r in range(1, 4)] + [row(4, test_accuracy=0.7)])
    write_config(under_way)
    write_rows(under_way, [row(1)])
    check_metric("test_accuracy", [RunFolder(done)])
    check_metric("test_loss", [RunFolder(done), RunFolder(under_way)])  # its evaluation is to come
    with pytest.raises(ConfigError) as refused:
        check_metric("test_loss", [RunFolder(done)])
    assert str(refused.value) == ("metric: expected a metric the runs logged: round_seconds, test_accuracy, "
                                  "train_loss, got 'test_loss'")
    check_metric("anything", [RunFolder(tmp_path / "not_started")])  # nothing logged yet: nothing refused


# Pace


def test_the_pace_leaves_out_the_first_rounds_warm_up_and_counts_evaluations(tmp_path):
    write_rows(tmp_path, [{"round": 1, "round_seconds": 9.0}, {"round": 2, "round_seconds": 1.0},
                          {"round": 3, "round_seconds": 1.0, "eval_seconds": 2.0}, {"round": 4, "round_seconds": 2.0}])
    pace = RunFolder(tmp_path).pace
    assert pace.round == 4
    assert pace.seconds_per_round == pytest.approx((1.0 + 3.0 + 2.0) / 3)
    assert pace.seconds_left(10) == pytest.approx(6 * 2.0)
    assert pace.seconds_left(3) == 0  # a run past the rounds asked for has none left


def test_one_timed_round_is_the_pace_and_untimed_rows_give_none(tmp_path):
    one, untimed = tmp_path / "one", tmp_path / "untimed"
    write_rows(one, [{"round": 1, "round_seconds": 4.0, "eval_seconds": 1.0}])
    write_rows(untimed, [{"round": 1}, {"round": 2}])
    assert RunFolder(one).pace == Pace(round=1, seconds_per_round=5.0)
    assert RunFolder(untimed).pace == Pace(round=2, seconds_per_round=None)
    assert RunFolder(untimed).pace.seconds_left(5) is None
    assert RunFolder(tmp_path / "none").pace is None


# State


def test_a_folder_without_anything_is_not_started(tmp_path):
    state = RunFolder(tmp_path).state(4)
    assert state == RunState(round=None, rounds=4, started=False)
    assert state.describe() == "not started" and state.round_logged is None


def test_a_run_that_wrote_its_config_but_no_checkpoint_is_started(tmp_path):
    write_config(tmp_path)
    write_rows(tmp_path, [row(1)])
    state = RunFolder(tmp_path).state(4)
    assert state.started and state.round is None and not state.finished
    assert state.describe() == "started, no checkpoint yet"
    assert state.round_logged == 1  # its rows got further than its checkpoints


def test_a_partial_run_is_at_its_newest_checkpoint(tmp_path):
    write_config(tmp_path)
    write_rows(tmp_path, [row(r) for r in range(1, 4)])
    write_checkpoint(tmp_path, 1, CONFIG)
    write_checkpoint(tmp_path, 2, CONFIG)
    state = RunFolder(tmp_path).state(4)
    assert (state.round, state.finished, state.stopped_early) == (2, False, False)
    assert state.hyperparameters == CONFIG
    assert state.describe() == "partial at round 2/4"
    assert state.round_logged == 3
    assert state.seconds_left == pytest.approx((4 - 3) * 0.5)
    assert RunFolder(tmp_path).state(None).describe() == "partial at round 2"


def test_a_run_that_reached_its_rounds_is_finished(tmp_path):
    write_config(tmp_path)
    write_rows(tmp_path, [row(r) for r in range(1, 5)])
    write_checkpoint(tmp_path, 4, CONFIG)
    state = RunFolder(tmp_path).state(4)
    assert state.finished and not state.stopped_early
    assert state.describe() == "finished" and state.seconds_left is None
    # Asked for more rounds, the same run has some left to train.
    assert not RunFolder(tmp_path).state(6).finished


def test_an_early_stopped_run_is_finished_short_of_its_rounds(tmp_path):
    write_config(tmp_path)
    write_rows(tmp_path, [row(1), row(2)])
    write_checkpoint(tmp_path, 2, CONFIG, final_stop="EarlyStopping: test_accuracy did not improve")
    state = RunFolder(tmp_path).state(4)
    assert state.finished and state.stopped_early
    assert state.describe() == "finished, stopped early at round 2/4"
    # Without the rounds asked for, nothing can be called finished.
    assert not RunFolder(tmp_path).state(None).finished


def test_a_checkpoint_past_the_rounds_asked_for_is_not_a_finished_run_of_them(tmp_path):
    write_config(tmp_path)
    write_checkpoint(tmp_path, 6, CONFIG)
    state = RunFolder(tmp_path).state(4)
    assert state.round == 6 and not state.finished


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_previous_one(tmp_path):
    write_config(tmp_path)
    write_checkpoint(tmp_path, 1, CONFIG)
    write_checkpoint(tmp_path, 2, CONFIG)
    (checkpoint_dir(tmp_path) / "round_000003.ckpt").write_bytes(b"cut short")
    assert RunFolder(tmp_path).state(4).round == 2


def test_a_run_whose_every_checkpoint_is_damaged_says_so(tmp_path):
    write_config(tmp_path)
    folder = checkpoint_dir(tmp_path)
    folder.mkdir()
    (folder / "round_000002.ckpt").write_bytes(b"cut short")
    (folder / "last.ckpt").write_bytes(b"also cut short")
    state = RunFolder(tmp_path).state(4)
    assert state.round is None and state.started and not state.finished
    assert state.describe() == "unusable: every checkpoint fails its checks"


# Difference from a config


def test_the_same_settings_are_the_same_experiment(tmp_path):
    write_config(tmp_path)
    assert RunFolder(tmp_path).difference(copy.deepcopy(CONFIG)) is None


def test_no_run_yet_differs_from_nothing(tmp_path):
    assert RunFolder(tmp_path).difference(with_setting(CONFIG, "data", "alpha", 0.1)) is None


def test_a_setting_that_defines_the_experiment_makes_it_another_one(tmp_path):
    write_config(tmp_path)
    different = RunFolder(tmp_path).difference(with_setting(CONFIG, "data", "alpha", 0.1))
    assert different == "data.alpha 0.5 -> 0.1 (config.yaml)"


def test_settings_that_only_change_how_a_run_is_carried_out_are_the_same_experiment(tmp_path):
    write_config(tmp_path)
    config = with_setting(with_setting(CONFIG, "federation", "rounds", 8), "federation", "eval_every", 1)
    assert RunFolder(tmp_path).difference(config) is None


def test_the_checkpoints_settings_are_compared_first(tmp_path):
    write_config(tmp_path)
    write_checkpoint(tmp_path, 2, with_setting(CONFIG, "federation", "num_clients", 20))
    run = RunFolder(tmp_path)
    assert run.difference(CONFIG, run.state(4)) == "federation.num_clients 20 -> 10 (the checkpoint of round 2)"
    # Without the state, config.yaml alone is read.
    assert run.difference(CONFIG) is None


def test_a_checkpoint_past_the_rounds_asked_for_is_another_experiment(tmp_path):
    write_config(tmp_path)
    write_checkpoint(tmp_path, 6, CONFIG)
    run = RunFolder(tmp_path)
    assert run.difference(CONFIG, run.state(4)) == ("federation.rounds: the checkpoint reached round 6, past the 4 "
                                                    "asked for")


# Finding and naming run folders


def test_a_pattern_keeps_the_folders_with_metrics_and_a_named_folder_is_kept_as_it_is(tmp_path):
    for name in ("b", "a", "c"):
        write_rows(tmp_path / "runs" / name, [row(1)])
    (tmp_path / "runs" / "empty").mkdir()
    found = find_runs([str(tmp_path / "runs" / "*"), tmp_path / "elsewhere"], recursive=False)
    assert found == [tmp_path / "runs" / name for name in ("a", "b", "c")] + [tmp_path / "elsewhere"]


def test_recursively_a_folder_stands_for_the_run_folders_below_it_once_each(tmp_path):
    for name in ("x/seed0", "x/seed1", "y/seed0"):
        write_rows(tmp_path / name, [row(1)])
    found = find_runs([tmp_path, tmp_path / "x" / "seed1"], recursive=True)
    assert found == [tmp_path / "x" / "seed0", tmp_path / "x" / "seed1", tmp_path / "y" / "seed0"]


def test_labels_are_the_shortest_endings_that_tell_runs_apart(tmp_path):
    assert run_labels([tmp_path / "fedavg", tmp_path / "scaffold"]) == ["fedavg", "scaffold"]
    assert run_labels([tmp_path / "fedavg" / "seed0", tmp_path / "scaffold" / "seed0"]) == ["fedavg/seed0",
                                                                                             "scaffold/seed0"]
