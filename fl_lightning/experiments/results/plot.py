"""The curves of a table (`fl-lightning table`).

Plot (`plot.png`): the metric against the round, or with `--x AXIS` against a cost counter (its x label
says its unit), one panel per setting, one line per method, the mean over the seeds counted with a band
from their minimum to their maximum (`--band minmax`) or mean ± std (`--band std`). On a cost axis the
runs of a method spend differently (their clients' draws differ), so its curve is taken evaluation by
evaluation: the k-th point is the mean of the runs' k-th evaluations and of what they had spent by them.
The title of a plan variant's plot names its overrides.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from fl_lightning.experiments.plans.overrides import describe_overrides
from fl_lightning.experiments.results.cost_axes import axis_label

if TYPE_CHECKING:
    from fl_lightning.experiments.results.table_cells import Table


def mean_curve(runs: list[list[tuple[float, float]]], band: str, axis: str = "rounds"
               ) -> tuple[list[float], list[float], list[float], list[float]]:
    """The x values (rounds, or on a cost axis the mean spent by each evaluation), the mean over the runs
    having that point, and the band's lower and upper edges."""
    by_round: dict[float, list[float]] = {}
    spent: dict[float, list[float]] = {}
    for points in runs:
        for index, (x, value) in enumerate(points):
            key = x if axis == "rounds" else index
            by_round.setdefault(key, []).append(value)
            spent.setdefault(key, []).append(x)
    rounds = sorted(by_round)
    means = [statistics.fmean(by_round[r]) for r in rounds]
    xs = [statistics.fmean(spent[r]) for r in rounds]
    if band == "std":
        spread = [statistics.stdev(by_round[r]) if len(by_round[r]) > 1 else 0.0 for r in rounds]
        return xs, means, [m - s for m, s in zip(means, spread)], [m + s for m, s in zip(means, spread)]
    return xs, means, [min(by_round[r]) for r in rounds], [max(by_round[r]) for r in rounds]


def plot_curves(result: Table, path: Path, band: str = "minmax") -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = len(result.settings)
    columns = min(panels, 3)
    rows = math.ceil(panels / columns)
    figure = Figure(figsize=(5 * columns, 3.8 * rows))
    FigureCanvasAgg(figure)
    axes_grid = figure.subplots(rows, columns, squeeze=False)
    unit = " (%)" if result.percent else ""
    for index, setting in enumerate(result.settings):
        axes = axes_grid[index // columns][index % columns]
        for method in result.methods:
            runs = result.curves[method, setting]
            if not runs:
                continue
            rounds, means, lower, upper = mean_curve(runs, band, result.x)
            (line,) = axes.plot(rounds, means, marker="." if len(rounds) < 30 else None,
                                label=f"{method} ({len(runs)})")
            axes.fill_between(rounds, lower, upper, color=line.get_color(), alpha=0.2, linewidth=0)
        if result.target is not None:  # the target the table's costs are to reach
            axes.axhline(result.target.threshold, color="grey", linestyle="--", linewidth=1)
        axes.set_title(result.labels[setting])
        axes.set_xlabel(axis_label(result.x))
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_ylabel(result.metric + unit)
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
    for index in range(panels, rows * columns):
        axes_grid[index // columns][index % columns].set_visible(False)
    band_text = "min–max over seeds" if band == "minmax" else "± sample std over seeds"
    # A variant's curves are not the plan's: its scale is in the title, as in the table's caption.
    variant = f"\n{result.plan}: {describe_overrides(result.overrides)}" if result.overrides else ""
    figure.suptitle(f"{result.metric}: mean, band {band_text}{variant}", fontsize="medium")
    save_laid_out(figure, path)


def save_laid_out(figure, path: Path) -> None:
    """Lays the figure out tightly (labels and legends inside it) and saves it as a PNG at 120 dpi."""
    figure.tight_layout()
    # tight_layout leaves a placeholder layout engine, for which savefig draws the figure once more
    # before drawing it into the file; the layout is already done.
    figure.set_layout_engine(None)
    figure.savefig(path, dpi=120)
