"""Run logs: metrics.jsonl and a Weights & Biases offline run (no network needed)."""

import json
from pathlib import Path

import pytest

from fl_lightning.cli import main
from fl_lightning.run_logging import MetricsLog, read_metrics

QUICKSTART = str(Path(__file__).parent.parent / "configs" / "quickstart.yaml")


def test_wandb_offline_run_holds_the_logged_metrics(tmp_path):
    main(["fit", "--config", QUICKSTART, "--federation.rounds", "2", "--federation.eval_every", "2",
          "--logger.wandb_mode", "offline", "--logger.progress_bar", "false", "--out_dir", str(tmp_path)])
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # The run file is protobuf; history keys and their JSON values are stored as plain text.
    records = runs[0].read_bytes()
    final = read_metrics(tmp_path)[-1]
    for key in ("train_loss", "round_seconds", "test_accuracy", "test_loss"):
        assert key.encode() in records
    assert json.dumps(final["test_accuracy"]).encode() in records
    assert b"fedavg" in records and b"digits" in records  # tags and config


def test_metrics_log_drops_rows_past_the_resumed_checkpoint(tmp_path):
    log = MetricsLog(tmp_path, resumed_round=0)
    for r in range(1, 6):
        log.append({"round": r, "train_loss": float(r)})
    MetricsLog(tmp_path, resumed_round=3)
    assert [row["round"] for row in read_metrics(tmp_path)] == [1, 2, 3]


def test_unreachable_wandb_server_falls_back_to_offline(tmp_path, monkeypatch):
    # A closed local port stands in for an unreachable server: the connection is refused at once.
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    with pytest.warns(UserWarning, match="logging offline instead"):
        main(["fit", "--config", QUICKSTART, "--federation.rounds", "1", "--logger.wandb_mode", "online",
              "--logger.progress_bar", "false", "--out_dir", str(tmp_path)])
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [row["round"] for row in read_metrics(tmp_path)] == [1]
