"""`fl-lightning compare`: local runs side by side, as a table and a plot, without W&B."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from fl_lightning.config import ConfigError
from fl_lightning.run_logging import read_metrics


def compare(runs: list[Path], metric: str = "test_accuracy", plot: Optional[Path] = None) -> list[dict]:
    """Print one row per run (its algorithm, rounds done, final and best value of `metric`) and
    optionally plot `metric` against the round for every run.

    Args:
        runs: output folders of `fl-lightning fit` (each holding metrics.jsonl and config.yaml).
        metric: a key of metrics.jsonl, e.g. test_accuracy, test_loss, train_loss.
        plot: PNG file to draw the curves into.

    Returns the rows printed.
    """
    rows, curves = [], {}
    for run in runs:
        history = read_metrics(run)
        if not history:
            raise ConfigError("runs", "folders written by `fl-lightning fit` (with metrics.jsonl)", str(run))
        points = [(row["round"], row[metric]) for row in history if row.get(metric) is not None]
        config = yaml.safe_load((Path(run) / "config.yaml").read_text()) if (Path(run) / "config.yaml").exists() else {}
        algorithm = (config.get("algorithm") or {}).get("class_path", "?").rsplit(".", 1)[-1]
        values = [value for _, value in points]
        rows.append({"run": str(run), "algorithm": algorithm, "rounds": history[-1]["round"],
                     f"final_{metric}": values[-1] if values else None, f"best_{metric}": max(values) if values else None})
        curves[str(run)] = points
    _print_table(rows)
    if plot is not None:
        _plot(curves, metric, Path(plot))
    return rows


def _print_table(rows: list[dict]) -> None:
    columns = list(rows[0])
    cells = [[_format(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for line in cells:
        print("  ".join(value.ljust(w) for value, w in zip(line, widths)))


def _format(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _plot(curves: dict[str, list[tuple[int, float]]], metric: str, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, points in curves.items():
        axes.plot([r for r, _ in points], [v for _, v in points], marker=".", label=name)
    axes.set_xlabel("round")
    axes.set_ylabel(metric)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
