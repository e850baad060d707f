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
  `fl-lightning compare`. In a table, `best` of a test metric is chosen off the test set: the
  metric at the evaluation of the run's best validation counterpart (`val_accuracy` for
  `test_accuracy`, `val_loss` for `test_loss`), for runs with a validation split
  (`data.validation`); a run without one falls back on the test metric's own best, and the notes
  under the table say which runs were selected on the test set.
- a run counts when it is finished: its metrics.jsonl reaches the rounds of its grid point (without
  a plan, the `federation.rounds` of its config.yaml), or its newest checkpoint records a final stop
  (an early stop: it counts at its last round, and the notes name it). Unfinished runs count only
  with `--include_partial true`, at their last logged round; otherwise n shows the seeds finished
  and the notes under the table name the runs left out and those not started.
- with a plan, each run's config.yaml is compared with its grid point's settings as `fit` compares
  them before a resume: a run made with other settings (the plan edited after it ran) is left out
  and named in the notes with the fields that differ, never averaged in.
- a torn last line of metrics.jsonl (a killed run, until it resumes) is left out, and the notes say
  so. A metric that no run logged is an error that lists the metrics the runs did log.
- the best cell of each column (highest mean, lowest for losses, compared as displayed; ties all
  marked) is bold in Markdown and has `<setting>:best` = 1 in the CSV.
- accuracy-like metrics (a name containing "accuracy") are shown in percent (`--percent`), with 2
  decimals for percentages and 4 otherwise (`--decimals`).

Reference CSV (the papers' numbers; `--reference`, or the plan's `reference:` when the table shows
the plan's `metric`): see reference.py. Every column of the table is then followed by `paper` and
`Δ` (ours minus the paper's, in percentage points), and the CSV gets `<setting>:paper` and
`<setting>:diff`.

table.csv has one row per method: `method`, then for each setting `<setting>:mean`, `:std`, `:n`,
`:best` (1 or 0), and with a reference `:paper`, `:diff`; numbers in the table's units (percent
for accuracy), empty where there is none.

Plot (`plot.png`): see plot.py.

Without a plan, the run folders are grouped by their layout: `.../<setting>/<method>/seed<k>` (the
layout plans write) gives the cell, any other folder is a method of its own (its folder name) in a
single column; every run found is expected, so nothing is reported as not started.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import itertools
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.overrides import value_text
from fl_lightning.experiments.plan import load_plan
from fl_lightning.experiments.plot import plot_curves
from fl_lightning.experiments.reference import paper_numbers
from fl_lightning.experiments.resolve import check_grid, resolve_grid
from fl_lightning.experiments.runs import (
    Run,
    best_value,
    find_runs,
    lower_is_better,
    other_experiment,
    parse_at,
    read_run,
    run_state,
    value_at,
)
from fl_lightning.run_dir import defining_settings
from fl_lightning.run_logging import METRICS_FILE

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
    config: Optional[dict] = None
    """The settings `fit` builds for the run's grid point; None without a plan."""

    @property
    def rounds(self) -> Optional[int]:
        return None if self.config is None else self.config["federation"]["rounds"]


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
          reference: Optional[Path] = None, runs_root: Path = Path("runs"),
          override: Optional[list[str]] = None) -> Table:
    """Tabulate a sweep as the papers do (methods x settings, mean ± std (n) over seeds) and plot its curves.

    Writes table.md, table.csv and plot.png into `out` and prints the Markdown table.

    Args:
        plan: a sweep plan (YAML file); several plans ([a.yaml, b.yaml], or given one after another) as
            one table, the paper's that they split (see _from_plans); or run folders / glob patterns of
            run folders (a folder that is not a run stands for the runs below it).
        metric: the column of metrics.jsonl to report; default the plan's `metric`, else test_accuracy.
        at: each run's value: final (the last logged), best or last:K (the mean of its last K
            evaluations). best of a test metric (test_accuracy) is its value at the round of the
            run's best validation counterpart (val_accuracy; the maximum, the minimum for losses),
            so that the test set chooses nothing; a run without a validation split (data.validation)
            falls back on the best of the test metric itself, which the notes say. best of another
            metric is its own maximum (minimum for losses).
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
        override: KEY=VALUE settings applied last to every grid point, as given to `fl-lightning sweep`
            (repeat --override for several): the table of that variant of the plan.
    """
    parse_at(at)
    loaded = _load_entries(plan, runs_root, override)
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
    selection = validation_metric(metric) if at == "best" else None
    chosen_on_validation, chosen_on_test = [], []
    missing, partial, excluded, empty, early, torn, other = [], [], [], [], [], [], []
    logged: set[str] = set()
    for entry in loaded.entries:
        run = read_run(entry.path)
        if run.torn_line:
            torn.append(entry)
        if not run.history:
            missing.append(entry)
            continue
        logged |= run.metrics_logged()
        different = None if entry.config is None else other_experiment(entry.path, entry.config)
        if different is None and entry.rounds is not None and run.rounds_done > entry.rounds:
            different = f"federation.rounds: it logged round {run.rounds_done}, past the {entry.rounds} of the plan"
        if different is not None:
            other.append(f"{_where(entry)} ({different})")
            continue
        rounds = entry.rounds or run.rounds_planned
        if rounds is None or run.rounds_done < rounds:
            # An early stop is final only by its checkpoint's word: a row count cannot tell it from a kill.
            if rounds is not None and run_state(entry.path, rounds).finished:
                early.append((entry, run))
            else:
                (partial if include_partial else excluded).append((entry, run))
                if not include_partial:
                    continue
        points = run.points(metric)
        if selection is not None and run.points(selection):
            value = value_at_best_round(run, metric, selection)
            chosen_on_validation.append(entry)
        else:
            value = value_at([v for _, v in points], metric, at)
            if selection is not None:
                chosen_on_test.append(entry)
        if value is None:
            empty.append(entry)
            continue
        cells[entry.method, entry.setting].values.append(value * scale)
        curves[entry.method, entry.setting].append([(r, v * scale) for r, v in points])

    if logged and metric not in logged:
        raise ConfigError("metric", f"a metric the runs logged: {', '.join(sorted(logged))}", metric)
    numbers = None
    if reference is not None:
        numbers = paper_numbers(Path(reference), methods, loaded.settings, loaded.labels)
    elif loaded.papers is not None and metric == loaded.metric:
        numbers = loaded.papers
    has_reference = numbers is not None
    if has_reference:
        unit = 1.0 if percent else 0.01
        for key, paper in numbers.items():
            cells[key].paper = None if paper is None else paper * unit
    for setting in loaded.settings:
        _mark_best([cells[m, setting] for m in methods], metric, decimals)

    notes = []
    if excluded:
        notes.append("not counted, unfinished (--include_partial true counts them): "
                     + _listing([_progress(e, r) for e, r in excluded]))
    if partial:
        notes.append("counted although unfinished: " + _listing([_progress(e, r) for e, r in partial]))
    if early:
        notes.append("finished early (a final stop in its checkpoint), counted at its last round: "
                     + _listing([_progress(e, r) for e, r in early]))
    if other:
        notes.append("not counted, made with other settings than the plan's (rerun them in folders of their own): "
                     + _listing(other))
    if torn:
        notes.append("a torn last line of metrics.jsonl left out (a killed run; resuming it rewrites the line): "
                     + _listing([_where(e) for e in torn]))
    if chosen_on_validation:
        notes.append(f"best: each run's {metric} at the evaluation of its best {selection} (model selection on "
                     f"the validation split, data.validation; the test set chooses nothing): "
                     f"{len(chosen_on_validation)} run(s)")
    if chosen_on_test:
        notes.append(f"best: selected on the test set itself, the best {metric} over the evaluations (no "
                     f"{selection} logged: no validation split, data.validation), an optimistic number: "
                     + _listing([_where(e) for e in chosen_on_test]))
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


def validation_metric(metric: str) -> Optional[str]:
    """What `--at best` chooses a round of `metric` by: val_X for a test metric test_X, None for a
    metric that is not the test set's (it is then its own best)."""
    return "val_" + metric.removeprefix("test_") if metric.startswith("test_") else None


def value_at_best_round(run: Run, metric: str, selection: str) -> Optional[float]:
    """`metric` at the run's evaluation of best `selection` (the earliest, on a tie), among the
    evaluations that logged both."""
    chosen, reported = dict(run.points(selection)), dict(run.points(metric))
    rounds = [r for r in chosen if r in reported]
    if not rounds:
        return None
    best = best_value([chosen[r] for r in rounds], selection)
    return reported[next(r for r in rounds if chosen[r] == best)]


def _where(entry: Entry) -> str:
    return f"{entry.setting}/{entry.method}/seed{entry.seed}"


def _progress(entry: Entry, run: Run) -> str:
    return f"{_where(entry)} (round {run.rounds_done}/{entry.rounds or run.rounds_planned or '?'})"


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
    papers: Optional[dict[tuple[str, str], Optional[float]]] = None
    """(row, setting) -> the paper's number, from each plan's reference: a table of several plans."""


def _load_entries(plan: Union[str, list[str]], runs_root: Path, overrides: Optional[list[str]] = None) -> _Loaded:
    if isinstance(plan, str) and Path(plan).is_file():
        return _from_plan(Path(plan), Path(runs_root), overrides)
    entries_given = [plan] if isinstance(plan, (str, Path)) else list(plan)
    if len(entries_given) > 1 and all(Path(entry).is_file() for entry in entries_given):
        return _from_plans([Path(entry) for entry in entries_given], Path(runs_root), overrides)
    if len(entries_given) == 1 and Path(entries_given[0]).is_file():
        return _from_plan(Path(entries_given[0]), Path(runs_root), overrides)
    if overrides:
        raise ConfigError("override", "a plan to apply it to (run folders are tabulated as they were run)",
                          overrides)
    paths = find_runs(entries_given, recursive=True)
    paths = [p for p in paths if (p / METRICS_FILE).is_file()]
    if not paths:
        raise ConfigError("plan", "a plan file, or run folders or a glob matching folders with metrics.jsonl",
                          plan)
    return _from_folders(paths)


def _from_plan(path: Path, runs_root: Path, overrides: Optional[list[str]] = None) -> _Loaded:
    plan = load_plan(path, runs_root=runs_root, overrides=overrides)
    grid = plan.grid()
    resolved = resolve_grid(grid)
    check_grid(path, resolved)
    settings = list(dict.fromkeys(point.setting_name for point in grid))
    axis_values = {axis: list(choices) for axis, choices in plan.settings.items()}
    labels = {point.setting_name: setting_label(point.setting, axis_values) for point in grid}
    reference = plan.reference
    if reference is not None and not reference.is_file() and (path.parent / reference).is_file():
        reference = path.parent / reference
    return _Loaded(entries=[Entry(e.point.method, e.point.setting_name, e.point.seed, e.point.out_dir, e.config)
                            for e in resolved],
                   methods=list(plan.methods), settings=settings, labels=labels, metric=plan.metric,
                   reference=reference, out=plan.runs_root / plan.name, plan_file=path)


def _from_plans(paths: list[Path], runs_root: Path, overrides: Optional[list[str]]) -> _Loaded:
    """Several plans as one table, the paper's table that they split (FedCONST's Table 1: a plan per
    model and federation). Columns are the plans' settings in the order the plans are given, each
    once; rows are their methods in that order. Plans that share a column (a setting name) are told
    apart by the settings that differ between them (`model.name` for FedCONST: lenet5, resnet18):
    each of their rows is prefixed with its values (`lenet5: FedAvg`; a number with its setting's
    name, `hidden=16: FedAvg`), so the table has a block of
    rows per value; plans without a shared column add columns to the same rows. A cell that two
    plans would fill is refused. Each plan's reference gives the numbers of its own cells."""
    parts = [_from_plan(path, runs_root, overrides) for path in paths]
    metrics = {str(part.plan_file): part.metric for part in parts}
    if len(set(metrics.values())) > 1:
        raise ConfigError("plan", "plans that report one metric (their `metric:`), to be one table", metrics)
    blocks = _row_blocks(parts)
    entries, methods, settings, owner = [], [], [], {}
    papers: dict[tuple[str, str], Optional[float]] = {}
    for part, block in zip(parts, blocks):
        rows = {method: f"{block}: {method}" if block else method for method in part.methods}
        for row, setting in itertools.product(rows.values(), part.settings):
            if (row, setting) in owner:
                raise ConfigError("plan", "plans that fill each cell of the table once", f"{row} | {setting} in "
                                  f"{owner[row, setting]} and {part.plan_file}")
            owner[row, setting] = part.plan_file
        methods += [row for row in rows.values() if row not in methods]
        settings += [setting for setting in part.settings if setting not in settings]
        entries += [dataclasses.replace(entry, method=rows[entry.method]) for entry in part.entries]
        if part.reference is not None:
            numbers = paper_numbers(part.reference, part.methods, part.settings, part.labels)
            papers.update({(rows[method], setting): number for (method, setting), number in numbers.items()})
    parsed = {setting: _parse_setting_name(setting) or {} for setting in settings}
    axis_values: dict[str, list[str]] = {}
    for setting in parsed.values():
        for axis, value in setting.items():
            axis_values.setdefault(axis, []).append(value)
    labels = {setting: setting_label(parsed[setting], axis_values) for setting in settings}
    names = [part.out.name for part in parts]
    digest = hashlib.sha256("+".join(names).encode()).hexdigest()[:8]
    prefix = os.path.commonprefix(names).rstrip("_-.@") or "plans"
    return _Loaded(entries=entries, methods=methods, settings=settings, labels=labels, metric=parts[0].metric,
                   reference=None, out=Path(runs_root) / f"{prefix}+{len(parts)}plans-{digest}",
                   papers=papers if any(part.reference is not None for part in parts) else None)


def _row_blocks(parts: list[_Loaded]) -> list[str]:
    """Per plan, what tells its rows apart from those of the plans that share a column with it: the
    values of the settings that differ between such plans (every run of a plan sharing them), or ""."""
    shared_by_all = []
    for part in parts:
        flat = [defining_settings(entry.config) for entry in part.entries]
        shared_by_all.append({name: value for name, value in flat[0].items()
                              if all(name in other and other[name] == value for other in flat[1:])})
    telling = set()
    for first, second in itertools.combinations(range(len(parts)), 2):
        if set(parts[first].settings) & set(parts[second].settings):
            a, b = shared_by_all[first], shared_by_all[second]
            telling |= {name for name in a.keys() | b.keys() if name not in a or name not in b or a[name] != b[name]}
    return [", ".join(_block_value(name, block.get(name, "?")) for name in sorted(telling)) for block in shared_by_all]


def _block_value(name: str, value) -> str:
    """`lenet5` (a name says what it is), `hidden=16` (a number does not)."""
    return value if isinstance(value, str) else f"{name.rsplit('.', 1)[-1]}={value_text(value)}"


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
