"""Run logs: metrics.jsonl (always), Weights & Biases through Fabric's logger (rank 0), a progress bar."""

from __future__ import annotations

import json
import math
import uuid
import warnings
from pathlib import Path
from typing import Optional

from fl_lightning.config import LoggerArgs

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """One JSON object per round in out_dir/metrics.jsonl; on resume, rows past the checkpoint are
    dropped so the file reads as one uninterrupted run."""

    def __init__(self, out_dir: Path, resumed_round: int):
        self.path = Path(out_dir) / METRICS_FILE
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["round"] <= resumed_round]
            self.path.write_text("".join(line + "\n" for line in kept))

    def append(self, metrics: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}) + "\n")


def read_metrics(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def wandb_logger(args: LoggerArgs, out_dir: Path, run_id: str, default_name: str, default_group: str,
                 tags: list[str]):
    """A `WandbLogger` resuming run `run_id`, or None when W&B is disabled. An unreachable server in
    online mode falls back to offline with a warning rather than failing the run."""
    if args.wandb_mode == "disabled":
        return None
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(
        project=args.project,
        name=args.name or default_name,
        group=args.group or default_group,
        tags=sorted(set(tags) | set(args.tags)),
        save_dir=str(out_dir),
        id=run_id,
        resume="allow",
        mode=args.wandb_mode,
        log_model=False,
        settings=_wandb_settings(args.wandb_mode),
    )


def _wandb_settings(mode: str):
    import wandb

    # A short init timeout lets the online -> offline fallback below happen quickly.
    return wandb.Settings(init_timeout=30, silent=True) if mode == "online" else wandb.Settings(silent=True)


def start_wandb(logger, hyperparameters: dict) -> Optional[object]:
    """Create the W&B run (rank 0) and log the resolved config; fall back to offline on failure."""
    if logger is None:
        return None
    try:
        logger.experiment
    except Exception as err:  # wandb raises several error types when the server is unreachable
        warnings.warn(f"W&B online init failed ({err}); logging offline instead", stacklevel=2)
        import wandb

        wandb.teardown()  # the failed run still holds its id in the W&B service
        logger._wandb_init["mode"] = "offline"
        logger.experiment
    logger.log_hyperparams(hyperparameters)
    return logger


def finish_wandb(logger) -> None:
    """Fabric never finalizes its loggers, and the logger's finalize leaves the W&B run open:
    close it so the run is marked finished (and an offline run is complete on disk)."""
    logger.finalize("success")
    logger.experiment.finish()
