"""The cells of `fl-lightning table` and their statistics over seeds, and the table laid out as
Markdown and CSV (see `fl_lightning.experiments.results.table` for what each shows)."""

from __future__ import annotations

import csv
import dataclasses
import io
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from fl_lightning.experiments.plans.overrides import describe_overrides
from fl_lightning.experiments.results.cost_axes import AXIS_UNITS, Target
from fl_lightning.experiments.results.statistics import (
    MIN_PAIRS,
    PairedDifference,
    PairedRatio,
    paired_difference,
    paired_ratio,
)
from fl_lightning.experiments.runs import budget_phrase
from fl_lightning.metric_names import best_value, lower_is_better


@dataclass
class Cell:
    by_seed: dict[int, float] = field(default_factory=dict)
    """Seed -> the value of that seed's run, for each seed counted, in the table's units."""
    paper: Optional[float] = None
    best: bool = False
    pending: bool = False
    """Runs of the cell are still training: a cell without a value yet shows "pending", not "–"."""
    unfinished_at: dict[int, int] = field(default_factory=dict)
    """Seed -> the round its run had reached, for each seed counted short of its rounds (--include_partial)."""
    versus: Optional[PairedDifference | PairedRatio] = None
    """With --baseline: the cell's values minus the baseline's of its column, seed by seed (with --target,
    its costs over the baseline's); None in the baseline's own cells (and where its row has no baseline)."""
    not_reached: list[int] = field(default_factory=list)
    """With --target: the seeds counted whose runs never reached it (in none of by_seed's values)."""

    @property
    def values(self) -> list[float]:
        return list(self.by_seed.values())

    @property
    def n(self) -> int:
        return len(self.by_seed)

    @property
    def not_reached_text(self) -> str:
        """`not reached by 2 of 5` (with --target, where a run counted never reached it), else ""."""
        if not self.not_reached:
            return ""
        return f"not reached by {len(self.not_reached)} of {self.n + len(self.not_reached)}"

    @property
    def mean(self) -> Optional[float]:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> Optional[float]:
        """Sample standard deviation (ddof = 1); None below two seeds."""
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    @property
    def diff(self) -> Optional[float]:
        return None if self.mean is None or self.paper is None else self.mean - self.paper


@dataclass
class Table:
    metric: str
    at: str
    methods: list[str]
    settings: list[str]
    labels: dict[str, str]
    cells: dict[tuple[str, str], Cell]
    curves: dict[tuple[str, str], list[list[tuple[int, float]]]]
    """(method, setting) -> the curve of every run counted."""
    percent: bool
    decimals: int
    reference: bool
    notes: list[str] = field(default_factory=list)
    baseline: Optional[str] = None
    """The method of `--baseline`: cells of the rows in `baseline_of` also show their paired difference."""
    baseline_of: dict[str, str] = field(default_factory=dict)
    """Row -> the row it is compared with (the baseline's rows have none)."""
    plan: str = ""
    """The plan's (or its variant's) name; "" for run folders."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """The overrides that make the plan's variant: the table says its runs are not at the plan's settings."""
    setting: str = ""
    """What the runs counted share of the setting a paper states (table_sources.describe_setting)."""
    choices: dict[tuple[str, str], str] = field(default_factory=dict)
    """(row, setting) -> the values its tuning stage chose, where one has."""
    tuning: str = ""
    """How the tuning stages chose (`on seed 100, by the best val_accuracy`); "" without one."""
    target: Optional[Target] = None
    """With --target: the cells are each run's cost to reach it on its axis, not the metric."""
    x: str = "rounds"
    """The axis of the curves (--x): rounds or a cost counter (fl_lightning.experiments.runs.BUDGET_AXES)."""

    def cell(self, method: str, setting: str) -> Cell:
        return self.cells[method, setting]

    def paired_text(self, method: str, setting: str) -> str:
        """The cell's paired difference to the baseline (paired_difference_text), `baseline` in the
        baseline's own cells."""
        return joined(*self.paired_parts(method, setting, self.paired_number))

    def paired_parts(self, method: str, setting: str, signed: Callable[[float], str], dash: str = "–"
                     ) -> tuple[str, str, bool]:
        """The cell's paired difference to the baseline in parts (paired_difference_parts), `baseline` in
        the baseline's own cells; `signed` writes a signed number."""
        if method not in self.baseline_of:
            return ("baseline" if method in self.baseline_of.values() else dash), "", False
        if not self.cells[method, setting].n:
            return dash, "", False
        return paired_difference_parts(self.cells[method, setting].versus, signed, dash)

    def paired_number(self, value: float) -> str:
        """A paired difference, signed (`+1.20`), or with --target a ratio of costs (`0.62`)."""
        return f"{value:.2f}" if self.target is not None else self.number(value, sign=True)

    def number(self, value: Optional[float], sign: bool = False) -> str:
        if value is None:
            return "–"
        return f"{value:+.{self.decimals}f}" if sign else f"{value:.{self.decimals}f}"

    def cell_text(self, cell: Cell) -> str:
        if cell.n == 0:
            return cell.not_reached_text or ("pending" if cell.pending else "–")
        text = self.number(cell.mean) + ("" if cell.std is None else f" ± {self.number(cell.std)}")
        return (f"**{text}**" if cell.best else text) + f" ({cell.n})" + (
            f"; {cell.not_reached_text}" if cell.not_reached else "")

    def markdown(self) -> str:
        header = ["method"]
        for setting in self.settings:
            header += [self.labels[setting], *self._extra_columns()]
        lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for method in self.methods:
            row = [method]
            for setting in self.settings:
                cell = self.cells[method, setting]
                row.append(self.cell_text(cell))
                if self.reference:
                    row += [self.number(cell.paper), self.number(cell.diff, sign=True)]
                if self.baseline is not None:
                    row.append(self.paired_text(method, setting))
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", *self.caption()]
        lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"

    def _extra_columns(self) -> list[str]:
        """The columns after each setting's: the paper's number and the difference to it, the paired
        difference to the baseline."""
        columns = ["paper", "Δ"] if self.reference else []
        return columns + ([f"vs {self.baseline}"] if self.baseline is not None else [])

    def caption(self) -> list[str]:
        """What the table shows, a sentence a line: the variant (when it is one), the metric, the
        paired differences."""
        if self.target is not None:
            return ([self.variant_sentence()] if self.overrides else []) + self.target_caption()
        unit = " (%)" if self.percent else ""
        at = {"final": "at the final round", "best": "at the best evaluation"}.get(
            self.at, budget_phrase(self.at) or f"mean of each run's last {self.at.partition(':')[2]} evaluations")
        direction = "lowest" if lower_is_better(self.metric) else "highest"
        lines = [self.variant_sentence()] if self.overrides else []
        lines.append(f"{self.metric}{unit}, {at} (--metric {self.metric} --at {self.at}): mean ± sample std (ddof = 1) "
                     f"over seeds (n = seeds counted); bold: the {direction} of its column"
                     + ("; paper: the reference's number, Δ: ours minus the paper's" if self.reference else "") + ".")
        if self.baseline is not None:
            lines.append(f"vs {self.baseline}: the mean over seeds of each run's {self.metric} minus that of the "
                         f"{self.baseline} run of its seed (the same partition and client sampling), with its 95% "
                         f"confidence interval (Student's t, n − 1 degrees of freedom) from {MIN_PAIRS} pairs on, * "
                         "where the interval excludes 0; with fewer pairs, or seeds without a pair, the mean "
                         "difference alone and no mark.")
        return lines

    def target_caption(self) -> list[str]:
        """The caption of a table of costs to reach a target (--target): the target and the axis, the
        runs not reached, the paired ratios."""
        target = self.target
        lines = [f"{target.axis} ({AXIS_UNITS[target.axis]}) to reach {target.goal} ({target.options}): each "
                 f"run's {target.axis} at its first evaluation {target.reached_by} {target.threshold:g}, mean ± "
                 "sample std (ddof = 1) over the seeds whose runs reached it (n); runs counted that never reached "
                 "it are shown as not reached by k of all counted; bold: the lowest of its column among the cells "
                 "whose runs all reached it."]
        if self.baseline is not None:
            lines.append(f"vs {self.baseline}: each run's {target.axis} over that of the {self.baseline} run of its "
                         "seed, over the seeds whose runs both reached the target: their geometric mean with its "
                         "95% confidence interval on the log scale (exp of mean(log ratio) ± t sd / √n, Student's t, "
                         f"n − 1 degrees of freedom) from {MIN_PAIRS} pairs on, * where the interval excludes 1; the "
                         "notes name the seeds left unpaired and why.")
        return lines

    def variant_sentence(self) -> str:
        paper = "; the paper's numbers are of the plan's own settings" if self.reference else ""
        return (f"Plan variant {self.plan}: the runs have {describe_overrides(self.overrides)} (--override), not "
                f"the plan's own settings{paper}.")

    def csv_text(self) -> str:
        columns = ["method"]
        for setting in self.settings:
            columns += [f"{setting}:{part}" for part in ("mean", "std", "n", "best")]
            columns += [f"{setting}:not_reached"] if self.target is not None else []
            columns += [f"{setting}:paper", f"{setting}:diff"] if self.reference else []
            paired = PAIRED_COLUMNS if self.target is None else RATIO_COLUMNS
            columns += [f"{setting}:{part}" for part in paired] if self.baseline is not None else []
        columns += ["metric", "at", "plan", "overrides", "baseline"]
        context = [self.metric, self.at, self.plan, describe_overrides(self.overrides), self.baseline or ""]
        if self.target is not None:
            columns += ["target", "x"]
            context += [f"{self.target.metric}={self.target.threshold:g}", self.target.axis]
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        for method in self.methods:
            row: list = [method]
            for setting in self.settings:
                cell = self.cells[method, setting]
                row += [_csv_number(cell.mean), _csv_number(cell.std), cell.n, int(cell.best)]
                row += [len(cell.not_reached)] if self.target is not None else []
                row += [_csv_number(cell.paper), _csv_number(cell.diff)] if self.reference else []
                row += _paired_csv(cell.versus) if self.baseline is not None else []
            writer.writerow(row + context)
        return buffer.getvalue()


def paired_difference_text(versus: PairedDifference, signed: Callable[[float], str], dash: str = "–",
                           mark: str = " *") -> str:
    """`+1.20 [+0.31, +2.09] *` (the mean difference, its 95% interval and `mark` where the interval
    excludes 0), or the mean alone, its pairs counted, where there is no interval to show (shown_interval):
    `+1.20 (2 pairs)`, `+1.20 (3 pairs; seed 3 unpaired)`; `dash` without any value."""
    return joined(*paired_difference_parts(versus, signed, dash), mark=mark)


def joined(mean: str, detail: str, marked: bool, mark: str = " *") -> str:
    """A paired difference's parts (paired_difference_parts) as one text: `+1.20 [+0.31, +2.09] *`."""
    return " ".join(filter(None, [mean, detail])) + (mark if marked else "")


def paired_difference_parts(versus: PairedDifference, signed: Callable[[float], str], dash: str = "–"
                            ) -> tuple[str, str, bool]:
    """What paired_difference_text shows, in parts: the mean difference (`dash`, or `no seed paired`,
    without one), what qualifies it (its interval `[+0.31, +2.09]`, else its pairs counted `(2 pairs)`,
    `(3 pairs; seed 3 unpaired)`, or ""), and whether it is marked (its interval excludes 0)."""
    if versus.n == 0:
        return ("no seed paired" if versus.unpaired else dash), "", False
    mean, pairs = signed(versus.mean), f"{versus.n} pair{'s' * (versus.n > 1)}"
    unpaired = ""
    if versus.unpaired:
        unpaired = f"seed{'s' * (len(versus.unpaired) > 1)} {', '.join(map(str, versus.unpaired))} unpaired"
    interval = shown_interval(versus)
    if interval is None:
        return mean, f"({'; '.join(filter(None, [pairs, unpaired]))})", False
    low, high = map(signed, interval)
    return mean, f"[{low}, {high}]" + (f" ({unpaired})" if unpaired else ""), versus.excludes_zero


def shown_interval(versus: PairedDifference | PairedRatio) -> Optional[tuple[float, float]]:
    """The 95% interval a table shows (and marks when it excludes 0): none below MIN_PAIRS pairs, nor
    where a seed of either side has no pair, since the pairs left are then only the seeds that both
    happened to finish, and the cell's mean is over other seeds than its difference. A ratio of costs to
    reach a target is by its definition over the seeds whose runs both reached it: its interval is shown
    with seeds unpaired, which the notes name."""
    return versus.interval if isinstance(versus, PairedRatio) or not versus.unpaired else None


PAIRED_COLUMNS = ("paired_diff", "paired_low", "paired_high", "paired_n", "paired_excludes_0", "unpaired_seeds")
"""table.csv's columns of a setting's paired difference to the baseline (`--baseline`)."""
RATIO_COLUMNS = ("paired_ratio", "paired_low", "paired_high", "paired_n", "paired_excludes_1", "unpaired_seeds")
"""Those of its paired ratio of costs to the baseline's (`--target --baseline`), in the same order."""


def _paired_csv(versus: Optional[PairedDifference]) -> list:
    """The PAIRED_COLUMNS of a cell, empty where there is nothing (the bounds and the mark without an interval)."""
    if versus is None:
        return [""] * len(PAIRED_COLUMNS)
    interval = shown_interval(versus)
    low, high = interval or (None, None)
    excludes = "" if interval is None else int(versus.excludes_zero)
    return [_csv_number(versus.mean), _csv_number(low), _csv_number(high), versus.n, excludes,
            " ".join(map(str, versus.unpaired))]


def _csv_number(value: Optional[float]) -> str:
    return "" if value is None else repr(round(value, 10))


def mark_best(cells: list[Cell], metric: str, decimals: int, cost: bool = False) -> None:
    """Bold the best mean as displayed (ties all): the metric's best, or with `cost` (--target) the lowest
    of the cells whose runs all reached the target, a mean over fewer runs being no lower cost."""
    candidates = [cell for cell in cells if cell.n and not cell.not_reached]
    shown = [round(cell.mean, decimals) for cell in candidates]
    if not shown:
        return
    best = min(shown) if cost else best_value(shown, metric)
    for cell in candidates:
        cell.best = round(cell.mean, decimals) == best


_CONST = re.compile(r"^(.*?)\s*\+\s*const$", re.IGNORECASE)


def order_methods(methods: list[str]) -> list[str]:
    """The given order, with each "X + CONST" moved right after X when X is there too."""
    bases = {method: _CONST.match(method).group(1) for method in methods if _CONST.match(method)}
    paired = {method: base for method, base in bases.items() if base in methods}
    ordered = []
    for method in methods:
        if method in paired:
            continue
        ordered.append(method)
        ordered += [const for const, base in paired.items() if base == method]
    return ordered


def pair_with_baseline(cells: dict[tuple[str, str], Cell], baseline_of: dict[str, str], settings: list[str],
                       costs: bool = False) -> list[str]:
    """Each compared row's cells minus its baseline row's, seed by seed (Cell.versus); with `costs` (--target)
    its costs over the baseline's (pair_costs). A seed whose run and the baseline's stand at other rounds
    (one of them counted unfinished, --include_partial) is not paired: their values are of other rounds.
    Returns those seeds, `setting/row/seed<k> at round 2, <baseline>'s finished`, or with `costs` the
    seeds pair_costs leaves unpaired."""
    apart = []
    for row, baseline in baseline_of.items():
        for setting in settings:
            cell, base = cells[row, setting], cells[baseline, setting]
            if costs:
                apart += pair_costs(cell, base, f"{setting}/{row}", baseline)
                continue
            other_rounds = sorted(seed for seed in cell.by_seed.keys() & base.by_seed.keys()
                                  if cell.unfinished_at.get(seed) != base.unfinished_at.get(seed))
            versus = paired_difference(_without(cell.by_seed, other_rounds), _without(base.by_seed, other_rounds))
            cell.versus = dataclasses.replace(versus, unpaired=sorted({*versus.unpaired, *other_rounds}))
            apart += [f"{setting}/{row}/seed{seed} {_reached(cell, seed)}, {baseline}'s {_reached(base, seed)}"
                      for seed in other_rounds]
    return apart


def pair_costs(cell: Cell, base: Cell, where: str, baseline: str) -> list[str]:
    """The cell's costs to reach the target over its baseline cell's (Cell.versus, a PairedRatio), over
    the seeds whose runs both reached it (a cost reached by a run still under way is a cost all the same).
    Returns the seeds left unpaired and why: `setting/row/seed<k> (not reached by <baseline>'s run)`."""
    cell.versus = paired_ratio(cell.by_seed, base.by_seed)
    unpaired = []
    for seed in sorted({*cell.by_seed, *cell.not_reached, *base.by_seed, *base.not_reached} - {*cell.versus.seeds}):
        why = [f"not reached by {name}" for name, side in (("its run", cell), (f"{baseline}'s run", base))
               if seed in side.not_reached]
        why += [f"no {name} counted" for name, side in (("run of its own", cell), (f"{baseline} run", base))
                if seed not in side.by_seed and seed not in side.not_reached]
        unpaired.append(f"{where}/seed{seed} ({', '.join(why)})")
    return unpaired


def _without(by_seed: dict[int, float], seeds: list[int]) -> dict[int, float]:
    return {seed: value for seed, value in by_seed.items() if seed not in seeds}


def _reached(cell: Cell, seed: int) -> str:
    return f"at round {cell.unfinished_at[seed]}" if seed in cell.unfinished_at else "finished"
