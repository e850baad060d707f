"""Reads the history rows of a W&B run file (run-<id>.wandb), as `wandb sync` would upload them
(the records as fl_lightning.wandb_file reads them)."""

import json
from pathlib import Path

from fl_lightning.wandb_file import MAGIC, read_records


def records(run_file: Path) -> list:
    assert Path(run_file).read_bytes()[:len(MAGIC)] == MAGIC, f"{run_file} is not a W&B run file"
    return read_records(run_file)


def history_rows(run_file: Path) -> list[dict]:
    """Every history row in the file, in order, as {key: value} (with W&B's `_step`)."""
    rows = []
    for record in records(run_file):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append(row)
    return rows


def run_record(run_file: Path):
    """The run's identity as the file records it: its `RunRecord` (display_name, run_group, tags, ...)."""
    found = records(run_file)
    runs = [r.run for r in found if r.WhichOneof("record_type") == "run"]
    assert runs, f"{run_file} holds no run record: {[r.WhichOneof('record_type') for r in found]}"
    return runs[0]


def run_config(run_file: Path) -> dict:
    """The run's W&B config as its run record holds it, {key: value}."""
    return {item.key: json.loads(item.value_json) for item in run_record(run_file).config.update}


def summary(run_file: Path) -> dict:
    """The run's summary as the file records it, {key: value}: every update, the last value of a key kept."""
    return {item.key or ".".join(item.nested_key): json.loads(item.value_json)
            for record in records(run_file) if record.WhichOneof("record_type") == "summary"
            for item in record.summary.update}
