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


def test_compare_tabulates_and_plots_local_runs(tmp_path, capsys):
    for name, accuracies in {"fedavg": [0.2, 0.5, 0.4], "ctpfl": [0.1, 0.3, 0.35]}.items():
        run = tmp_path / name
        run.mkdir()
        log = MetricsLog(run, resumed_round=0)
        for round_index, accuracy in enumerate(accuracies, start=1):
            log.append({"round": round_index, "train_loss": 1.0, "test_accuracy": accuracy})
        (run / "config.yaml").write_text(f"algorithm:\n  class_path: fl_lightning.algorithms.{name}.X{name}\n")
    plot = tmp_path / "curves.png"
    main(["compare", "--runs", f"[{tmp_path / 'fedavg'}, {tmp_path / 'ctpfl'}]", "--plot", str(plot)])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["run", "algorithm", "rounds", "final_test_accuracy", "best_test_accuracy"]
    assert printed[1].split()[1:] == ["Xfedavg", "3", "0.4000", "0.5000"]
    assert printed[2].split()[1:] == ["Xctpfl", "3", "0.3500", "0.3500"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_rejects_a_folder_without_metrics(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--runs", f"[{tmp_path}]"])
    assert exit_info.value.code == 2
    assert "runs" in capsys.readouterr().err
