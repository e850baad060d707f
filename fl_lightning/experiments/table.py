"""`fl-lightning table`: a sweep's results laid out as the papers' tables, with their curves.

    fl-lightning table --plan plans/fedconst_table3.yaml                 # a plan's runs
    fl-lightning table --plan "runs/fedconst_table3/*/*/seed*"           # or run folders, or a glob
    fl-lightning table --plan plan.yaml --at best --include_partial true --out results/

Table (`table.md`, printed, and `table.csv`):

- rows are the plan's methods in the plan's order, except that a method named "X + CONST" comes right
  after the method X when the plan has both; columns are the plan's settings, labelled from their
  axis values (`dataset: cifar10, alpha: 0.5` -> "CIFAR-10, α = 0.5"; an axis with one value in the
  whole plan is left out of the labels).
- each cell is `mean ± std (n)` over seeds, n being the number of seeds counted; the std is the
  sample standard deviation (ddof = 1, as papers report it), left out when n = 1; a cell without
  runs is "–".
- the value of one run is taken (`--at`) at the final round (`final`, the default: the last value
  logged), at its best evaluation (`best`: the maximum, or the minimum for a metric whose name
  contains "loss"), or as the mean of its last k evaluations (`last:k`). The same rule serves
  `fl-lightning compare`.
- a run counts when it is finished: its metrics.jsonl reaches the `federation.rounds` of its
  config.yaml. Unfinished runs (also those stopped early by a callback) count only with
  `--include_partial true`, at their last logged round; otherwise n shows the seeds finished and
  the notes under the table name the runs left out and those not started.
- the best cell of each column (highest mean, lowest for losses, compared as displayed; ties all
  marked) is bold in Markdown and has `<setting>:best` = 1 in the CSV.
- accuracy-like metrics (a name containing "accuracy") are shown in percent (`--percent`), with 2
  decimals for percentages and 4 otherwise (`--decimals`).

Reference CSV (the papers' numbers; `--reference`, or the plan's `reference:` when the table shows
the plan's `metric`): a header row
`method,<setting>,<setting>,...`, then one row per method. Method names are the plan's (matched
exactly, else by their folder form, "FedAvg + CONST" = "fedavg+const"); setting columns are the
plan's setting names, i.e. the run folders' names (`dataset-cifar10_alpha-0.5`; the Markdown labels
are accepted too); values are in percent (`71.2`; a trailing `± 0.3` is ignored), an empty field
meaning not reported. Methods or settings of the CSV that the table lacks are ignored. For example

    method,alpha-0.5,alpha-0.1
    FedAvg,71.20,65.02
    FedAvg + CONST,74.51,

Every column of the table is then followed by `paper` and `Δ` (ours minus the paper's, in
percentage points), and the CSV gets `<setting>:paper` and `<setting>:diff`.

table.csv has one row per method: `method`, then for each setting `<setting>:mean`, `:std`, `:n`,
`:best` (1 or 0), and with a reference `:paper`, `:diff`; numbers in the table's units (percent
for accuracy), empty where there is none.

Plot (`plot.png`): the metric against the round, one panel per setting, one line per method, the
mean over the seeds counted with a band from their minimum to their maximum (`--band minmax`) or
mean ± std (`--band std`).

Without a plan, the run folders are grouped by their layout: `.../<setting>/<method>/seed<k>` (the
layout plans write) gives the cell, any other folder is a method of its own (its folder name) in a
single column; every run found is expected, so nothing is reported as not started.
"""

from __future__ import annotations

import csv
import glob
import io
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

import yaml

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plan import load_plan, slug
from fl_lightning.run_logging import METRICS_FILE, read_metrics

# --------------------------------------------------------------------------------------------------
# One run: its config and metrics, and the one rule for its final / best / last-k value.


@dataclass
class Run:
    """A folder written by `fl-lightning fit`."""

    path: Path
    config: dict
    history: list[dict]

    @property
    def rounds_done(self) -> int:
        return self.history[-1]["round"] if self.history else 0

    @property
    def rounds_planned(self) -> Optional[int]:
        return (self.config.get("federation") or {}).get("rounds")

    @property
    def finished(self) -> bool:
        return self.rounds_planned is not None and self.rounds_done >= self.rounds_planned

    @property
    def algorithm(self) -> str:
        algorithm = self.config.get("algorithm") or {}
        class_path = algorithm.get("class_path", "?") if isinstance(algorithm, dict) else str(algorithm)
        return class_path.rsplit(".", 1)[-1]

    def points(self, metric: str) -> list[tuple[int, float]]:
        """(round, value) of every row that logged `metric`."""
        return [(row["round"], row[metric]) for row in self.history if row.get(metric) is not None]


def read_run(path: Path) -> Run:
    """The run in `path`: config.yaml (empty if absent) and metrics.jsonl."""
    path = Path(path)
    config_file = path / "config.yaml"
    config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
    return Run(path=path, config=config if isinstance(config, dict) else {}, history=read_metrics(path))


def lower_is_better(metric: str) -> bool:
    """Losses are minimised; every other metric (accuracies) is maximised."""
    return "loss" in metric.lower()


def best_value(values: list[float], metric: str) -> float:
    return min(values) if lower_is_better(metric) else max(values)


AT_CHOICES = "final, best or last:K (the mean of the last K evaluations, K >= 1)"


def parse_at(at: str) -> tuple[str, int]:
    """"final" -> ("final", 1), "best" -> ("best", 0), "last:5" -> ("last", 5)."""
    if at == "final":
        return "final", 1
    if at == "best":
        return "best", 0
    match = re.fullmatch(r"last:(\d+)", at)
    if match and int(match.group(1)) >= 1:
        return "last", int(match.group(1))
    raise ConfigError("at", AT_CHOICES, at)


def value_at(values: list[float], metric: str, at: str) -> Optional[float]:
    """One run's value of `metric` (its logged values in round order): final, best or last:k."""
    if not values:
        return None
    rule, k = parse_at(at)
    if rule == "best":
        return best_value(values, metric)
    return statistics.fmean(values[-k:])


def find_runs(entries: list, recursive: bool) -> list[Path]:
    """Run folders from folders and glob patterns, in the order given (a pattern's matches sorted).

    A pattern keeps only the folders it matches that hold metrics.jsonl. A folder named outright is
    kept as it is (the caller checks it), unless `recursive` and it holds no metrics.jsonl itself:
    then the run folders below it are taken."""
    found: list[Path] = []
    for entry in entries:
        entry = str(entry)
        if glob.has_magic(entry):
            candidates = [Path(p) for p in sorted(glob.glob(entry))]
            if recursive:
                candidates = [run for candidate in candidates for run in _runs_below(candidate)]
            found += [c for c in candidates if (c / METRICS_FILE).is_file()]
        elif recursive and not (Path(entry) / METRICS_FILE).is_file():
            found += _runs_below(Path(entry))
        else:
            found.append(Path(entry))
    return list(dict.fromkeys(found))


def _runs_below(folder: Path) -> list[Path]:
    if (folder / METRICS_FILE).is_file():
        return [folder]
    if not folder.is_dir():
        return []
    return sorted(p.parent for p in folder.rglob(METRICS_FILE))


def run_labels(paths: list[Path]) -> list[str]:
    """The shortest trailing part of each path that tells the runs apart: the folder name, or
    `method/seed0`, ... when folder names repeat."""
    parts = [Path(p).resolve().parts for p in paths]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


# --------------------------------------------------------------------------------------------------
# The table.


@dataclass
class Cell:
    values: list[float] = field(default_factory=list)
    """One value per seed counted, in the table's units."""
    paper: Optional[float] = None
    best: bool = False

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
class Entry:
    """A run the table expects: its row, column, seed and folder."""

    method: str
    setting: str
    seed: int
    path: Path


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
            return "–"
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


def table(plan: Union[str, list[str]], metric: Optional[str] = None, at: str = "final",
          include_partial: bool = False, out: Optional[Path] = None, percent: Optional[bool] = None,
          decimals: Optional[int] = None, band: Literal["minmax", "std"] = "minmax",
          reference: Optional[Path] = None, runs_root: Path = Path("runs")) -> Table:
    """Tabulate a sweep as the papers do (methods x settings, mean ± std (n) over seeds) and plot its curves.

    Writes table.md, table.csv and plot.png into `out` and prints the Markdown table.

    Args:
        plan: a sweep plan (YAML file), or run folders / glob patterns of run folders (a folder
            that is not a run stands for the runs below it).
        metric: the column of metrics.jsonl to report; default the plan's `metric`, else test_accuracy.
        at: each run's value: final (the last logged), best (maximum, minimum for losses) or last:K
            (the mean of its last K evaluations).
        include_partial: count runs that have not reached their config's federation.rounds, at their
            last round.
        out: folder for table.md, table.csv and plot.png; default runs/<plan>/, or the folder
            holding the runs given.
        percent: show the metric in percent; default: for metrics whose name contains "accuracy".
        decimals: decimals shown; default 2 in percent, else 4.
        band: the band drawn around each mean curve over seeds: minmax (minimum to maximum) or std
            (mean ± sample std).
        reference: CSV of the papers' numbers (method, one column per setting, percent); default
            the plan's `reference` when the metric is the plan's.
        runs_root: the folder holding runs/<plan>/ of a plan.
    """
    parse_at(at)
    loaded = _load_entries(plan, runs_root)
    metric = metric or loaded.metric
    percent = "accuracy" in metric.lower() if percent is None else percent
    if decimals is None:
        decimals = 2 if percent else 4
    if decimals < 0:
        raise ConfigError("decimals", "an integer >= 0", decimals)
    scale = 100.0 if percent else 1.0
    if reference is None and metric == loaded.metric:  # the plan's numbers are of the plan's metric
        reference = loaded.reference

    methods = order_methods(loaded.methods)
    cells = {(m, s): Cell() for m in methods for s in loaded.settings}
    curves: dict[tuple[str, str], list] = {key: [] for key in cells}
    missing, partial, excluded, empty = [], [], [], []
    for entry in loaded.entries:
        run = read_run(entry.path)
        if not run.history:
            missing.append(entry)
            continue
        if not run.finished:
            (partial if include_partial else excluded).append((entry, run))
            if not include_partial:
                continue
        points = run.points(metric)
        value = value_at([v for _, v in points], metric, at)
        if value is None:
            empty.append(entry)
            continue
        cells[entry.method, entry.setting].values.append(value * scale)
        curves[entry.method, entry.setting].append([(r, v * scale) for r, v in points])

    has_reference = reference is not None
    if has_reference:
        _fill_reference(cells, Path(reference), loaded, methods, 1.0 if percent else 0.01)
    for setting in loaded.settings:
        _mark_best([cells[m, setting] for m in methods], metric, decimals)

    notes = []
    if excluded:
        notes.append("not counted, unfinished (--include_partial true counts them): "
                     + _listing([_progress(e, r) for e, r in excluded]))
    if partial:
        notes.append("counted although unfinished: " + _listing([_progress(e, r) for e, r in partial]))
    if missing:
        notes.append("not started: " + _listing([_where(e) for e in missing]))
    if empty:
        notes.append(f"no {metric} logged: " + _listing([_where(e) for e in empty]))

    result = Table(metric=metric, at=at, methods=methods, settings=loaded.settings, labels=loaded.labels,
                   cells=cells, curves=curves, percent=percent, decimals=decimals, reference=has_reference,
                   notes=notes)
    out = Path(out) if out is not None else loaded.out
    out.mkdir(parents=True, exist_ok=True)
    markdown = result.markdown()
    (out / "table.md").write_text(markdown)
    (out / "table.csv").write_text(result.csv_text())
    plot_curves(result, out / "plot.png", band)
    print(markdown, end="")
    print(f"\nwritten: {out / 'table.md'}, {out / 'table.csv'}, {out / 'plot.png'}")
    return result


def _where(entry: Entry) -> str:
    return f"{entry.setting}/{entry.method}/seed{entry.seed}"


def _progress(entry: Entry, run: Run) -> str:
    return f"{_where(entry)} (round {run.rounds_done}/{run.rounds_planned or '?'})"


def _listing(items: list[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _mark_best(cells: list[Cell], metric: str, decimals: int) -> None:
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


# --------------------------------------------------------------------------------------------------
# What to tabulate: a plan's grid, or run folders.


@dataclass
class _Loaded:
    entries: list[Entry]
    methods: list[str]
    settings: list[str]
    labels: dict[str, str]
    metric: str
    reference: Optional[Path]
    out: Path
    plan_file: Optional[Path] = None


def _load_entries(plan: Union[str, list[str]], runs_root: Path) -> _Loaded:
    if isinstance(plan, str) and Path(plan).is_file():
        return _from_plan(Path(plan), Path(runs_root))
    entries_given = [plan] if isinstance(plan, (str, Path)) else list(plan)
    paths = find_runs(entries_given, recursive=True)
    paths = [p for p in paths if (p / METRICS_FILE).is_file()]
    if not paths:
        raise ConfigError("plan", "a plan file, or run folders or a glob matching folders with metrics.jsonl",
                          plan)
    return _from_folders(paths)


def _from_plan(path: Path, runs_root: Path) -> _Loaded:
    plan = load_plan(path, runs_root=runs_root)
    grid = plan.grid()
    settings = list(dict.fromkeys(point.setting_name for point in grid))
    axis_values = {axis: list(choices) for axis, choices in plan.settings.items()}
    labels = {point.setting_name: setting_label(point.setting, axis_values) for point in grid}
    reference = plan.reference
    if reference is not None and not reference.is_file() and (path.parent / reference).is_file():
        reference = path.parent / reference
    return _Loaded(entries=[Entry(p.method, p.setting_name, p.seed, p.out_dir) for p in grid],
                   methods=list(plan.methods), settings=settings, labels=labels, metric=plan.metric,
                   reference=reference, out=plan.runs_root / plan.name, plan_file=path)


_SEED = re.compile(r"seed(\d+)")


def _from_folders(paths: list[Path]) -> _Loaded:
    entries = []
    for path in paths:
        seed = _SEED.fullmatch(path.name)
        if seed and path.parent.name and path.parent.parent.name:
            entries.append(Entry(path.parent.name, path.parent.parent.name, int(seed.group(1)), path))
        else:
            entries.append(Entry(path.name, "", int(read_run(path).config.get("seed") or 0), path))
    settings = list(dict.fromkeys(e.setting for e in entries))
    parsed = {s: _parse_setting_name(s) for s in settings}
    axis_values: dict[str, list[str]] = {}
    for setting in parsed.values():
        for axis, value in (setting or {}).items():
            axis_values.setdefault(axis, []).append(value)
    labels = {s: (setting_label(parsed[s], axis_values) if parsed[s] else s or "runs") for s in settings}
    common = Path(os.path.commonpath([str(p.resolve()) for p in paths]))
    out = common.parent if (common / METRICS_FILE).is_file() else common
    return _Loaded(entries=entries, methods=list(dict.fromkeys(e.method for e in entries)), settings=settings,
                   labels=labels, metric="test_accuracy", reference=None, out=out)


def _parse_setting_name(name: str) -> Optional[dict[str, str]]:
    """"dataset-cifar10_alpha-0.5" -> {dataset: cifar10, alpha: 0.5}; None when not of that form."""
    setting = {}
    for part in name.split("_"):
        axis, dash, value = part.partition("-")
        if not dash or not axis or not value:
            return None
        setting[axis] = value
    return setting or None


DATASET_NAMES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "tinyimagenet": "Tiny-ImageNet",
                 "tiny-imagenet": "Tiny-ImageNet", "tiny_imagenet": "Tiny-ImageNet", "digits": "digits"}
AXIS_SYMBOLS = {"alpha": "α", "dirichlet": "α", "beta": "β", "gamma": "γ", "mu": "μ", "rho": "ρ"}


def setting_label(setting: dict[str, str], axis_values: dict[str, list[str]]) -> str:
    """A column label from a setting's axis values; an axis with a single value everywhere is left
    out (unless every axis is)."""
    varying = {a: v for a, v in setting.items() if len(set(axis_values.get(a, []))) > 1} or setting
    if not varying:
        return "default"
    parts = []
    for axis, value in varying.items():
        if axis.lower() in ("dataset", "data"):
            parts.append(DATASET_NAMES.get(value.lower(), value))
        else:
            parts.append(f"{AXIS_SYMBOLS.get(axis.lower(), axis)} = {value}")
    return ", ".join(parts)


def read_reference(path: Path) -> dict[str, dict[str, Optional[float]]]:
    """The reference CSV (see the module docstring): method -> column -> the paper's number (percent)."""
    try:
        lines = list(csv.reader(io.StringIO(Path(path).read_text(encoding="utf-8-sig"))))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ConfigError("reference", "a readable CSV file (method, then one column per setting)",
                          f"{path} ({err})") from err
    header = [column.strip() for column in lines[0]] if lines else []
    if not header or header[0] != "method":
        raise ConfigError("reference", "a CSV whose first column is `method`", f"{path} (columns {header})")
    table: dict[str, dict[str, Optional[float]]] = {}
    for line, fields in enumerate(lines[1:], start=2):
        if not any(text.strip() for text in fields):
            continue
        row = dict(zip(header, fields))
        method = (row.get("method") or "").strip()
        values = {}
        for column, text in row.items():
            if column == "method":
                continue
            number = (text or "").split("±")[0].strip()
            if not number:
                values[column] = None
                continue
            try:
                values[column] = float(number)
            except ValueError:
                raise ConfigError("reference", "numbers in percent or empty fields",
                                  f"{text!r} in {path}, line {line}, column {column}") from None
        table[method] = values
    return table


def _fill_reference(cells: dict[tuple[str, str], Cell], path: Path, loaded: _Loaded, methods: list[str],
                    scale: float) -> None:
    if not path.is_file():
        raise ConfigError("reference", "an existing CSV file of the papers' numbers", str(path))
    reference = read_reference(path)
    by_slug = {slug(name): values for name, values in reference.items()}
    for method in methods:
        values = reference.get(method) or by_slug.get(slug(method)) or {}
        for setting in loaded.settings:
            paper = values.get(setting, values.get(loaded.labels[setting]))
            cells[method, setting].paper = None if paper is None else paper * scale


# --------------------------------------------------------------------------------------------------
# The plot.


def mean_curve(runs: list[list[tuple[int, float]]], band: str) -> tuple[list[int], list[float], list[float],
                                                                         list[float]]:
    """Rounds, mean over the runs having that round, and the band's lower and upper edges."""
    by_round: dict[int, list[float]] = {}
    for points in runs:
        for round_index, value in points:
            by_round.setdefault(round_index, []).append(value)
    rounds = sorted(by_round)
    means = [statistics.fmean(by_round[r]) for r in rounds]
    if band == "std":
        spread = [statistics.stdev(by_round[r]) if len(by_round[r]) > 1 else 0.0 for r in rounds]
        return rounds, means, [m - s for m, s in zip(means, spread)], [m + s for m, s in zip(means, spread)]
    return rounds, means, [min(by_round[r]) for r in rounds], [max(by_round[r]) for r in rounds]


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
            rounds, means, lower, upper = mean_curve(runs, band)
            (line,) = axes.plot(rounds, means, marker="." if len(rounds) < 30 else None,
                                label=f"{method} ({len(runs)})")
            axes.fill_between(rounds, lower, upper, color=line.get_color(), alpha=0.2, linewidth=0)
        axes.set_title(result.labels[setting])
        axes.set_xlabel("round")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_ylabel(result.metric + unit)
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
    for index in range(panels, rows * columns):
        axes_grid[index // columns][index % columns].set_visible(False)
    band_text = "min–max over seeds" if band == "minmax" else "± sample std over seeds"
    figure.suptitle(f"{result.metric}: mean, band {band_text}", fontsize="medium")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
