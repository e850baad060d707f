"""The cells of `fl-lightning table` and their statistics over seeds, and the table laid out as
Markdown and CSV (see `fl_lightning.experiments.table` for what each shows)."""

from __future__ import annotations

import csv
import io
import re
import statistics
from dataclasses import dataclass, field
from typing import Optional

from fl_lightning.metric_names import best_value, lower_is_better


@dataclass
class Cell:
    values: list[float] = field(default_factory=list)
    """One value per seed counted, in the table's units."""
    paper: Optional[float] = None
    best: bool = False
    pending: bool = False
    """Runs of the cell are still training: a cell without a value yet shows "pending", not "–"."""

    @property
    def n(self) -> int:
        return len(self.values)

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

    def cell(self, method: str, setting: str) -> Cell:
        return self.cells[method, setting]

    def _number(self, value: Optional[float], sign: bool = False) -> str:
        if value is None:
            return "–"
        return f"{value:+.{self.decimals}f}" if sign else f"{value:.{self.decimals}f}"

    def cell_text(self, cell: Cell) -> str:
        if cell.n == 0:
            return "pending" if cell.pending else "–"
        text = self._number(cell.mean) + ("" if cell.std is None else f" ± {self._number(cell.std)}")
        return (f"**{text}**" if cell.best else text) + f" ({cell.n})"

    def markdown(self) -> str:
        header = ["method"]
        for setting in self.settings:
            header += [self.labels[setting], "paper", "Δ"] if self.reference else [self.labels[setting]]
        lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for method in self.methods:
            row = [method]
            for setting in self.settings:
                cell = self.cells[method, setting]
                row.append(self.cell_text(cell))
                if self.reference:
                    row += [self._number(cell.paper), self._number(cell.diff, sign=True)]
            lines.append("| " + " | ".join(row) + " |")
        unit = " (%)" if self.percent else ""
        at = {"final": "at the final round", "best": "at the best evaluation"}.get(
            self.at, f"mean of each run's last {self.at.partition(':')[2]} evaluations")
        direction = "lowest" if lower_is_better(self.metric) else "highest"
        lines += ["", f"{self.metric}{unit}, {at}: mean ± sample std (ddof = 1) over seeds (n = seeds counted); "
                      f"bold: the {direction} of its column"
                      + ("; paper: the reference's number, Δ: ours minus the paper's" if self.reference else "")
                      + "."]
        lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"

    def csv_text(self) -> str:
        columns = ["method"]
        for setting in self.settings:
            columns += [f"{setting}:{part}" for part in ("mean", "std", "n", "best")]
            columns += [f"{setting}:paper", f"{setting}:diff"] if self.reference else []
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        for method in self.methods:
            row: list = [method]
            for setting in self.settings:
                cell = self.cells[method, setting]
                row += [_csv_number(cell.mean), _csv_number(cell.std), cell.n, int(cell.best)]
                row += [_csv_number(cell.paper), _csv_number(cell.diff)] if self.reference else []
            writer.writerow(row)
        return buffer.getvalue()


def _csv_number(value: Optional[float]) -> str:
    return "" if value is None else repr(round(value, 10))


def mark_best(cells: list[Cell], metric: str, decimals: int) -> None:
    shown = [round(cell.mean, decimals) for cell in cells if cell.n]
    if not shown:
        return
    best = best_value(shown, metric)
    for cell in cells:
        cell.best = cell.n > 0 and round(cell.mean, decimals) == best


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
