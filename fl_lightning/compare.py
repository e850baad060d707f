"""`fl-lightning compare`: local runs side by side, as a table and a plot, without W&B.

Runs are read, and their final and best values taken, by the same code as `fl-lightning table`
(`fl_lightning.experiments.table`): "best" is the maximum, or the minimum for a metric whose name
contains "loss".
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.table import find_runs, read_run, run_labels, value_at


def compare(runs: Union[list[Path], str], metric: str = "test_accuracy", plot: Optional[Path] = None) -> list[dict]:
    """Print one row per run (its algorithm, rounds done, final and best value of `metric`) and
    optionally plot `metric` against the round for every run.

    Args:
        runs: output folders of `fl-lightning fit` (each holding metrics.jsonl and config.yaml), as a
            list or a glob pattern ("runs/sweep/*"); patterns may also be list items.
        metric: a key of metrics.jsonl, e.g. test_accuracy, test_loss, train_loss.
        plot: PNG file to draw the curves into, each labelled by its run folder's name.

    Returns the rows printed.
    """
    paths = find_runs([runs] if isinstance(runs, (str, Path)) else list(runs), recursive=False)
    if not paths:
        raise ConfigError("runs", "folders written by `fl-lightning fit` (with metrics.jsonl)", str(runs))
    rows, curves = [], {}
    for path, label in zip(paths, run_labels(paths)):
        run = read_run(path)
        if not run.history:
            raise ConfigError("runs", "folders written by `fl-lightning fit` (with metrics.jsonl)", str(path))
        points = run.points(metric)
        values = [value for _, value in points]
        rows.append({"run": str(path), "algorithm": run.algorithm, "rounds": run.rounds_done,
                     f"final_{metric}": value_at(values, metric, "final"),
                     f"best_{metric}": value_at(values, metric, "best")})
        curves[label] = points
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
