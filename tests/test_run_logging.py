"""Run logs: metrics.jsonl and a Weights & Biases offline run (no network needed)."""

import re
import types
from pathlib import Path

import pytest
from paths import QUICKSTART
from wandb_records import history_rows, records, summary

from fl_lightning.commands.main import main
from fl_lightning.metric_names import COST_COUNTERS
from fl_lightning.run_dir import recorded_config
from fl_lightning.run_logging import MetricsLog, read_metrics


def offline_run_files(out_dir: Path) -> list[Path]:
    return sorted((out_dir / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.slow
def test_wandb_offline_run_holds_the_logged_metrics(tmp_path):
    main(["fit", "--config", QUICKSTART, "--federation.rounds", "2", "--federation.eval_every", "2",
          "--logger.wandb_mode", "offline", "--logger.progress_bar", "false", "--out_dir", str(tmp_path)])
    (run_file,) = offline_run_files(tmp_path)
    rows = history_rows(run_file)
    assert [row["_step"] for row in rows] == [1, 2]
    for logged, written in zip(rows, read_metrics(tmp_path)):
        assert {key: logged[key] for key in written} == written
    run_info = [r for r in records(run_file) if r.WhichOneof("record_type") == "run"][0].run
    assert {"method=fedavg", "dataset=digits", "constraint=none", "model=mlp"} <= set(run_info.tags)
    assert re.fullmatch(r"digits-alpha0\.5-mlp-fedavg-[0-9a-f]{8}", run_info.run_group)
    assert run_info.display_name == f"fedavg-seed0-{run_info.run_group.rsplit('-', 1)[1]}"
    recorded = summary(run_file)
    accuracies = {row["round"]: row["test_accuracy"] for row in read_metrics(tmp_path) if "test_accuracy" in row}
    assert recorded["final_test_accuracy"] == accuracies[max(accuracies)]
    # No validation split: the best is the test set's own, and the summary says so.
    best = recorded["best_test_accuracy"]
    assert best == accuracies[recorded["best_test_accuracy_round"]] == max(accuracies.values())
    assert recorded["best_test_accuracy_selected_on"] == "test_accuracy"
    # The cost counters are declared as metrics (the dashboard's x-axes), and the summary holds the run's totals.
    declared = {r.metric.name: r.metric for r in records(run_file) if r.WhichOneof("record_type") == "metric"}
    assert set(COST_COUNTERS) <= set(declared)
    assert all(declared[counter].options.defined for counter in COST_COUNTERS)
    assert {counter: recorded[counter] for counter in COST_COUNTERS} == {
        counter: read_metrics(tmp_path)[-1][counter] for counter in COST_COUNTERS}


@pytest.mark.slow
def test_resumed_offline_run_replays_the_rounds_before_the_checkpoint(tmp_path):
    """A resumed run writes a new offline file; it must hold every round, so that syncing it
    alone gives the whole history."""
    common = ["fit", "--config", QUICKSTART, "--federation.eval_every", "2", "--logger.wandb_mode", "offline",
              "--logger.progress_bar", "false", "--checkpoint.every", "2", "--resume", "auto",
              "--out_dir", str(tmp_path)]
    main([*common, "--federation.rounds", "3"])
    main([*common, "--federation.rounds", "5"])
    first, resumed = offline_run_files(tmp_path)
    assert [row["_step"] for row in history_rows(first)] == [1, 2, 3]
    assert [row["_step"] for row in history_rows(resumed)] == [1, 2, 3, 4, 5]
    assert [row["round"] for row in history_rows(resumed)] == [row["round"] for row in read_metrics(tmp_path)]


@pytest.mark.slow
def test_wandb_mode_in_the_environment_takes_the_place_of_the_configs(tmp_path, monkeypatch,
                                                                    wandb_reads_the_environment_afresh):
    """`WANDB_MODE=offline fl-lightning fit ...` with the shipped settings (logger.wandb_mode: disabled)
    logs offline, and the run's config.yaml records the mode it logged with."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    main(["fit", "--config", QUICKSTART, "--federation.rounds", "1", "--logger.progress_bar", "false",
          "--out_dir", str(tmp_path)])
    (run_file,) = offline_run_files(tmp_path)
    assert [row["_step"] for row in history_rows(run_file)] == [1]
    assert recorded_config(tmp_path)["logger"]["wandb_mode"] == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    main(["fit", "--config", QUICKSTART, "--federation.rounds", "1", "--logger.progress_bar", "false",
          "--logger.wandb_mode", "offline", "--out_dir", str(tmp_path / "disabled")])
    assert not (tmp_path / "disabled" / "wandb").exists()


def test_metrics_log_starts_from_the_checkpoint_history(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"round": {r}}}\n' for r in range(1, 6)) + '{"round": 6, "tr')
    log = MetricsLog(tmp_path, history=[{"round": 1}, {"round": 2}, {"round": 3}])
    log.append({"round": 4, "train_loss": 0.5})
    assert read_metrics(tmp_path) == [{"round": 1}, {"round": 2}, {"round": 3}, {"round": 4, "train_loss": 0.5}]


@pytest.mark.slow
def test_unreachable_wandb_server_falls_back_to_offline(tmp_path, monkeypatch):
    # A closed local port stands in for an unreachable server: the connection is refused at once.
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    # W&B retries a refused connection until its init timeout: a short one keeps the test quick.
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    with pytest.warns(UserWarning, match="logging offline instead"):
        main(["fit", "--config", QUICKSTART, "--federation.rounds", "1", "--logger.wandb_mode", "online",
              "--logger.progress_bar", "false", "--out_dir", str(tmp_path)])
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [row["round"] for row in read_metrics(tmp_path)] == [1]


@pytest.mark.parametrize("environment, expected_s", [({}, 30.0), ({"WANDB_INIT_TIMEOUT": "7.5"}, 7.5)])
def test_online_init_waits_wandbs_own_init_timeout_when_set(environment, expected_s, tmp_path, monkeypatch):
    import wandb

    from fl_lightning.config import LoggerArgs
    from fl_lightning.run_logging import WandbIdentity, WandbRun

    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    settings = []
    run_opened = types.SimpleNamespace(define_metric=lambda name: None)  # a run, as far as _init uses one
    monkeypatch.setattr(wandb, "init", lambda **arguments: settings.append(arguments["settings"]) or run_opened)
    run = WandbRun(LoggerArgs(wandb_mode="online"), tmp_path, WandbIdentity("id", "name", "group", []))
    run._init("online", {})
    run._init("offline", {})
    assert settings[0].init_timeout == expected_s
    assert settings[1].init_timeout == wandb.Settings().init_timeout  # offline: W&B's own default


def test_a_wandb_init_timeout_that_is_no_number_is_named(tmp_path, monkeypatch):
    from fl_lightning.config import LoggerArgs
    from fl_lightning.run_logging import WandbIdentity, WandbRun

    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "soon")
    run = WandbRun(LoggerArgs(wandb_mode="online"), tmp_path, WandbIdentity("id", "name", "group", []))
    with pytest.raises(ValueError, match="WANDB_INIT_TIMEOUT: expected a number of seconds, got 'soon'"):
        run._init("online", {})


@pytest.mark.slow
def test_an_empty_wandb_variable_is_taken_as_unset(tmp_path, monkeypatch, capsys, wandb_reads_the_environment_afresh):
    """`WANDB_MODE= fl-lightning fit ...`: W&B refuses a variable set but empty (a pydantic
    ValidationError), which would leave the run without W&B."""
    monkeypatch.setenv("WANDB_MODE", "")
    monkeypatch.setenv("WANDB_SILENT", "")
    main(["fit", "--config", QUICKSTART, "--federation.rounds", "1", "--logger.wandb_mode", "offline",
          "--logger.progress_bar", "false", "--out_dir", str(tmp_path)])
    (run_file,) = offline_run_files(tmp_path)
    assert [row["_step"] for row in history_rows(run_file)] == [1]
    assert "W&B" not in capsys.readouterr().err


def test_an_unknown_wandb_mode_is_refused_before_anything_is_trained(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", QUICKSTART, "--logger.wandb_mode", "offline", "--out_dir", str(tmp_path / "run")])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: WANDB_MODE: expected one of online, offline, disabled, dryrun, shared, run, or unset, got 'ofline'"]
    assert not (tmp_path / "run").exists()


class BrokenWandbRun:
    """A W&B run whose service died (as when Slurm kills it with the ranks)."""

    step = 0

    def log(self, *args, **kwargs):
        raise ConnectionResetError(104, "Connection reset by peer")

    def finish(self):
        raise ConnectionResetError(104, "Connection reset by peer")


@pytest.mark.slow
def test_a_wandb_failure_does_not_stop_training(tmp_path, monkeypatch, capsys):
    from fl_lightning.run_logging import WandbRun

    monkeypatch.setattr(WandbRun, "_init", lambda self, mode, hyperparameters: BrokenWandbRun())
    main(["fit", "--config", QUICKSTART, "--federation.rounds", "3", "--logger.wandb_mode", "offline",
          "--logger.progress_bar", "false", "--out_dir", str(tmp_path)])
    assert [row["round"] for row in read_metrics(tmp_path)] == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "round_000003.ckpt").is_file()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "W&B log failed" in line]
    assert len(warnings) == 1 and "ConnectionResetError" in warnings[0]  # reported once, then W&B is off


TWO_SHORT_ROUNDS = ["fit", "--config", QUICKSTART, "--model.options", "{hidden: 16, depth: 1}",
                    "--federation.rounds", "2", "--federation.local_steps", "2", "--federation.eval_every", "2",
                    "--logger.wandb_mode", "offline", "--logger.progress_bar", "false"]


# Reads of the run's file that find it unwritten, in the test of a late W&B service.
LATE_READS = 5


@pytest.mark.slow
def test_fit_waits_for_a_wandb_service_that_writes_the_run_file_late(tmp_path, monkeypatch, capsys):
    """What a loaded machine does by chance, made certain: the run's file reads as unwritten the
    first LATE_READS times after run.finish has returned, and fit returns only once it reads the
    file holding every round and the run's end."""
    from fl_lightning import run_logging

    reads, read_records = [], run_logging.read_records

    def late_service(run_file):
        reads.append(run_file)
        return [] if len(reads) <= LATE_READS else read_records(run_file)

    monkeypatch.setattr(run_logging, "read_records", late_service)
    main([*TWO_SHORT_ROUNDS, "--out_dir", str(tmp_path)])
    assert len(reads) > LATE_READS
    assert "warning" not in capsys.readouterr().err
    (run_file,) = offline_run_files(tmp_path)
    assert [row["_step"] for row in history_rows(run_file)] == [1, 2]
    assert records(run_file)[-1].WhichOneof("record_type") == "exit"


@pytest.mark.slow
def test_a_wandb_file_that_stays_unwritten_is_reported_naming_what_it_lacks(tmp_path, monkeypatch, capsys):
    from fl_lightning import run_logging

    monkeypatch.setattr(run_logging, "RUN_FILE_WAIT_S", 0.2)
    monkeypatch.setattr(run_logging, "read_records", lambda run_file: [])  # a service that never writes
    main([*TWO_SHORT_ROUNDS, "--out_dir", str(tmp_path)])
    (run_file,) = offline_run_files(tmp_path)
    assert (f"warning: 0.2 s after W&B finished the run, its file {run_file} lacks rounds [1, 2] and the record of "
            "the run's end; metrics.jsonl holds every round") in capsys.readouterr().err
    assert [row["round"] for row in read_metrics(tmp_path)] == [1, 2]
