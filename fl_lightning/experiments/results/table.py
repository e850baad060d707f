"""`fl-lightning table`: a sweep's results laid out as the papers' tables, with their curves.

    fl-lightning table --plan plans/fedconst_table3.yaml                 # a plan's runs
    fl-lightning table --plan "runs/fedconst_table3/*/*/seed*"           # or run folders, or a glob
    fl-lightning table --plan plan.yaml --at best --include_partial true --out results/
    fl-lightning table --plan plan.yaml --baseline FedAvg --format latex # paired differences, table.tex

Table (`table.md`, printed, and `table.csv`):

- rows are the plan's methods in the plan's order, except that a method named "X + CONST" comes right
  after the method X when the plan has both; columns are the plan's settings, labelled from their
  axis values (`dataset: cifar10, alpha: 0.5` -> "CIFAR-10, α = 0.5"; an axis with one value in the
  whole plan is left out of the labels).
- each cell is `mean ± std (n)` over seeds, n being the number of seeds counted; the std is the
  sample standard deviation (ddof = 1, as papers report it), left out when n = 1; a cell without
  runs is "–", and one whose runs are still training, none counted yet, "pending".
- the value of one run is taken (`--at`) at the final round (`final`, the default: the last value
  logged), at its best evaluation (`best`: the maximum, or the minimum for a metric whose name
  contains "loss"), or as the mean of its last k evaluations (`last:k`). `best` of a test metric
  is chosen off the test set, as everywhere (fl_lightning.metric_names.best_round): the metric at
  the evaluation of the run's best validation counterpart (`val_accuracy` for `test_accuracy`,
  `val_loss` for `test_loss`), for runs with a validation split (`data.validation`); a run without
  one falls back on the test metric's own best, and the notes under the table say which runs were
  selected on the test set.
- a run counts when it is finished: its metrics.jsonl reaches the rounds of its grid point (without
  a plan, the `federation.rounds` of its config.yaml), or its newest checkpoint records a final stop
  (an early stop: it counts at its last round, and the notes name it). Unfinished runs count only
  with `--include_partial true`, at their last logged round; otherwise n shows the seeds finished
  and the notes under the table name the runs left out and those not started.
- with a plan, each run's config.yaml is compared with its grid point's settings as `fit` compares
  them before a resume: a run made with other settings (the plan edited after it ran) is left out
  and named in the notes with the fields that differ, never averaged in. Only the points that have
  runs are resolved (a grid's points without a run are not started, whatever their settings), and
  one whose settings `fit` refuses refuses the plan; but a point naming a module of the user's that
  this process cannot import (an algorithm or model by its dotted path, PYTHONPATH unset) is read as
  its run's config.yaml recorded it, unchecked, and the notes say so.
- a torn last line of metrics.jsonl (a killed run, until it resumes) is left out, and the notes say
  so. A run without metrics rows but with a checkpoint (a kill between the checkpoint and the log)
  is not "not started": the notes name its checkpoint's round and the command that rewrites the
  rows from it. A metric that no run logged, nor will log at an evaluation to come (a run's config
  schedules them: test_*, val_* with a validation split, ...; while a sweep runs, before the first
  evaluation, these are all the runs will have logged), is an error that lists those metrics.
- the best cell of each column (highest mean, lowest for losses, compared as displayed; ties all
  marked) is bold in Markdown and has `<setting>:best` = 1 in the CSV.
- accuracy-like metrics (a name containing "accuracy") are shown in percent (`--percent`), with 2
  decimals for percentages and 4 otherwise (`--decimals`).

Cost to reach a target (`--target test_accuracy=0.5 --x grad_evals`, cost_axes.py): each cell is, over
seeds, what the runs had spent on the axis (rounds, samples, grad_evals, upload_bytes, bytes, seconds;
rounds by default) at their first evaluation at or above the target (at or below for a loss), mean ±
std over the runs that reached it; runs counted that never reach it are counted and shown (`1200 ± 80
(3); not reached by 2 of 5`), never dropped, and the notes name them. Lower is best: bold is the lowest
mean among the cells whose runs all reached it. With `--baseline`, the paired ratio of each run's cost
to its seed's baseline run's, over the seeds whose runs both reached it: the geometric mean and its 95%
interval on the log scale (statistics.PairedRatio), `*` where it excludes 1; the notes name the seeds
left unpaired and why. table.md's caption, table.csv's `target` and `x` columns (and each setting's
`:not_reached`, and with a baseline its RATIO_COLUMNS) and the LaTeX caption say the target and the
axis; the files are named `table-<metric>-to-<value>-<axis>.md`. A --target of another form, an --x
that is no axis, a --metric other than the target's, an --at or a --reference are refused before any
run is read. Without a target, `--x AXIS` draws the plot's curves on that axis, its files named with it
(`plot-test_accuracy-final-grad_evals.png`) beside the plan's.

Reference CSV (the papers' numbers; `--reference`, or the plan's `reference:` when the table shows
the plan's `metric`): see reference.py. Every column of the table is then followed by `paper` and
`Δ` (ours minus the paper's, in percentage points), and the CSV gets `<setting>:paper` and
`<setting>:diff`.

Paired differences (`--baseline METHOD`): the runs of one seed share the partition and the clients
sampled, so a method is compared with the baseline seed by seed, d_s = value_s - baseline_s
(statistics.py). After each setting's columns a column `vs METHOD` shows the mean of the d_s and its
95% confidence interval (Student's t, n - 1 degrees of freedom), `*` where the interval excludes 0;
below 3 pairs, or where a seed of either side has no pair, the mean alone with its pairs counted
and the seeds unpaired, no interval and no mark (table_cells.shown_interval). A seed whose run and
the baseline's stand at other rounds (one counted unfinished, --include_partial) is not paired, and
the notes name it (table_cells.pair_with_baseline). The baseline's own cells say `baseline`. In a
table of several plans, a method name is the baseline of each block of rows that has it (`lenet5:
FedAvg` for `lenet5: ...`); the notes name the blocks that have none, compared with nothing.

A plan variant (`--override`, overrides.py) is not the plan's scale: the first line of the caption
names its overrides (the paper's numbers are the plan's), as do the plot's title and table.csv, and
the table's folder gets variant.yaml.

table.csv has one row per method: `method`, then for each setting `<setting>:mean`, `:std`, `:n`,
`:best` (1 or 0), with a reference `:paper`, `:diff`, with a baseline `:paired_diff`, `:paired_low`,
`:paired_high`, `:paired_n`, `:paired_excludes_0` (1 or 0, empty without an interval),
`:unpaired_seeds`; then `metric`, `at`, `plan` (the variant's name), `overrides` and `baseline`,
alike in every row. Numbers are in the table's units (percent for accuracy), empty where there is none.

Files: table.md, table.csv and plot.png (and with `--format latex` table.tex, table_latex.py) for the
plan's metric at the final round; a table of another `--metric` or `--at` is written beside them as
table-<metric>-<at>.md, ... (`table-test_loss-best.md`, `plot-test_accuracy-last5.png`), never over
them, and its caption says which it is (`--metric test_loss --at best`).

Plot (`plot.png`): see plot.py.

Without a plan, the run folders are grouped by their layout: `.../<setting>/<method>/seed<k>` (the
layout plans write) gives the cell, any other folder is a method of its own (its folder name) in a
single column; every run found is expected, so nothing is reported as not started.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from fl_lightning.atomic_files import write_text_atomically
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.overrides import write_variant_file
from fl_lightning.experiments.results.cost_axes import Target, parse_axis, parse_target
from fl_lightning.experiments.results.plot import plot_curves
from fl_lightning.experiments.results.reference import paper_numbers
from fl_lightning.experiments.results.table_cells import Cell, Table, mark_best, order_methods, pair_with_baseline
from fl_lightning.experiments.results.table_latex import latex_table
from fl_lightning.experiments.results.table_outcomes import Outcome, Outcomes, Verdict, judge
from fl_lightning.experiments.results.table_sources import Loaded, describe_setting, load_entries
from fl_lightning.experiments.runs import check_metric, parse_at


def table(plan: Union[str, list[str]], metric: Optional[str] = None, at: str = "final",
          include_partial: bool = False, out: Optional[Path] = None, percent: Optional[bool] = None,
          decimals: Optional[int] = None, band: Literal["minmax", "std"] = "minmax",
          reference: Optional[Path] = None, runs_root: Path = Path("runs"),
          override: Optional[list[str]] = None, baseline: Optional[str] = None,
          format: Literal["markdown", "latex"] = "markdown", target: Optional[str] = None,
          x: Optional[str] = None) -> Table:
    """Tabulate a sweep as the papers do (methods x settings, mean ± std (n) over seeds) and plot its curves.

    Writes table.md, table.csv and plot.png into `out` (named with the metric and `at` unless they are
    the plan's metric at its final round: table-test_loss-best.md) and prints the Markdown table.

    Args:
        plan: a sweep plan (YAML file); several plans ([a.yaml, b.yaml], or given one after another) as
            one table, the paper's that they split (see table_sources._from_plans); or run folders / glob patterns of
            run folders (a folder that is not a run stands for the runs below it).
        metric: the column of metrics.jsonl to report; default the plan's `metric`, else test_accuracy.
        at: each run's value: final (the last logged), best or last:K (the mean of its last K
            evaluations). best of a test metric (test_accuracy) is its value at the round of the
            run's best validation counterpart (val_accuracy; the maximum, the minimum for losses),
            so that the test set chooses nothing; a run without a validation split (data.validation)
            falls back on the best of the test metric itself, which the notes say. best of another
            metric is its own maximum (minimum for losses). AXIS=BUDGET (grad_evals=2e6): its value at
            its last evaluation within a budget of rounds, samples, grad_evals, upload_bytes, bytes (up
            and down) or seconds (the clients' compute), from the cost counters of its rows; a run whose
            evaluations end short of the budget has no value, and the notes say so.
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
        baseline: a method (row) to compare every other with, seed by seed: each cell gets the mean
            paired difference and its 95% confidence interval (from 3 pairs), marked * where it excludes 0.
        format: latex also writes table.tex (booktabs), beside table.md and table.csv.
        target: METRIC=VALUE (test_accuracy=0.5): each cell is the runs' cost on the axis --x to reach it
            (their first evaluation at or above it, at or below for a loss), runs that never reach it
            counted as not reached; with --baseline, the paired ratio of costs.
        x: the axis of the costs to reach --target (rounds by default) and of the plot's curves: rounds,
            samples, grad_evals, upload_bytes, bytes or seconds.
    """
    parse_at(at)
    goal = None if target is None else parse_target(target, x, metric, at, reference)
    axis = parse_axis(x or "rounds")
    loaded = load_entries(plan, runs_root, override)
    metric = goal.metric if goal is not None else metric or loaded.metric
    shown = _shown(metric, percent, decimals, goal)
    verdicts = [judge(entry, metric, at, include_partial, axis, goal) for entry in loaded.entries]
    check_metric(metric, [verdict.run for verdict in verdicts if verdict.run is not None])
    result = _laid_out(loaded, verdicts, metric, at, shown, reference, baseline, goal)
    result.x = axis
    write_table(result, loaded, Path(out) if out is not None else loaded.out, band, format)
    return result


@dataclass(frozen=True)
class Shown:
    """How the table shows the metric."""

    percent: bool
    decimals: int

    @property
    def scale(self) -> float:
        return 100.0 if self.percent else 1.0


def _shown(metric: str, percent: Optional[bool], decimals: Optional[int], target: Optional[Target]) -> Shown:
    """Percent for accuracy-like metrics, 2 decimals in percent, 4 otherwise; a cost (--target) as it is,
    whole (2 decimals for seconds)."""
    if target is not None:
        percent, decimals = False, (2 if target.axis == "seconds" else 0) if decimals is None else decimals
    percent = "accuracy" in metric.lower() if percent is None else percent
    decimals = (2 if percent else 4) if decimals is None else decimals
    if decimals < 0:
        raise ConfigError("decimals", "an integer >= 0", decimals)
    return Shown(percent, decimals)


def _laid_out(loaded: Loaded, verdicts: list[Verdict], metric: str, at: str, shown: Shown,
              reference: Optional[Path], baseline: Optional[str], target: Optional[Target]) -> Table:
    """The table of the verdicts' values: cells and curves, the papers' numbers, the best of each
    column, the pairs with the baseline, the notes."""
    baseline_of = loaded.baselines(baseline) if baseline is not None else {}
    if reference is None and metric == loaded.metric:  # the plan's numbers are of the plan's metric
        reference = loaded.reference
    methods = order_methods(loaded.methods)
    cells, curves = _cells(verdicts, methods, loaded.settings, shown.scale)
    # The papers' numbers are of the metric, not of a cost to reach it.
    has_reference = target is None and _add_paper_numbers(cells, loaded, reference, metric, methods, shown.percent)
    for setting in loaded.settings:
        mark_best([cells[m, setting] for m in methods], metric, shown.decimals, cost=target is not None)
    apart = pair_with_baseline(cells, baseline_of, loaded.settings, costs=target is not None)
    uncompared = loaded.blocks_without(baseline) if baseline is not None else []
    outcomes = Outcomes.of(verdicts)
    for key in outcomes.cells_under_way():
        cells[key].pending = True
    return Table(metric=metric, at=at, methods=methods, settings=loaded.settings, labels=loaded.labels,
                 cells=cells, curves=curves, percent=shown.percent, decimals=shown.decimals,
                 reference=has_reference,
                 notes=outcomes.notes(metric) + _baseline_notes(baseline, apart, uncompared, target) + loaded.notes,
                 baseline=baseline, baseline_of=baseline_of, plan=loaded.name, overrides=loaded.overrides,
                 setting=describe_setting([verdict.entry.config or verdict.run.config for verdict in verdicts
                                           if verdict.outcome is Outcome.COUNTED and verdict.value is not None]),
                 choices=loaded.choices, tuning=loaded.tuning, target=target)


def _baseline_notes(baseline: Optional[str], apart: list[str], uncompared: list[str], target: Optional[Target]
                    ) -> list[str]:
    """What --baseline leaves unpaired: seeds at other rounds than the baseline's, or with a target the seeds
    whose runs did not both reach it (pair_with_baseline), and the blocks of rows of a plan without the
    baseline."""
    notes = []
    if apart and target is not None:
        notes.append(f"not paired with the baseline, their run and the {baseline} run of their seed not both having "
                     f"reached {target.goal}: " + ", ".join(apart))
    elif apart:
        notes.append("not paired with the baseline, its run and the baseline's of its seed at other rounds (the "
                     "values of an unfinished run, --include_partial, are of the round it has reached): "
                     + ", ".join(apart))
    if uncompared:
        notes.append(f"not compared with {baseline}: the rows of {', '.join(uncompared)}, whose plan has no "
                     f"{baseline}")
    return notes


def _cells(verdicts: list[Verdict], methods: list[str], settings: list[str], scale: float
           ) -> tuple[dict[tuple[str, str], Cell], dict[tuple[str, str], list]]:
    """(method, setting) -> its cell of the values counted, by seed, and the curves of its runs."""
    cells = {(m, s): Cell() for m in methods for s in settings}
    curves: dict[tuple[str, str], list] = {key: [] for key in cells}
    for verdict in verdicts:
        entry = verdict.entry
        if verdict.outcome is not Outcome.COUNTED or (verdict.value is None and not verdict.missed_target):
            continue
        curves[entry.method, entry.setting].append([(r, v * scale) for r, v in verdict.points])
        if verdict.missed_target:  # counted, as not reached (--target)
            cells[entry.method, entry.setting].not_reached.append(entry.seed)
            continue
        cells[entry.method, entry.setting].by_seed[entry.seed] = verdict.value * scale
        if verdict.unfinished == "partial":
            cells[entry.method, entry.setting].unfinished_at[entry.seed] = verdict.run.rounds_done
    return cells, curves


def _add_paper_numbers(cells: dict[tuple[str, str], Cell], loaded: Loaded, reference: Optional[Path], metric: str,
                       methods: list[str], percent: bool) -> bool:
    """Give the cells the papers' numbers, from `reference` or the plans' own; False when there are none."""
    numbers = None
    if reference is not None:
        numbers = paper_numbers(Path(reference), methods, loaded.settings, loaded.labels)
    elif loaded.papers is not None and metric == loaded.metric:
        numbers = loaded.papers
    if numbers is None:
        return False
    unit = 1.0 if percent else 0.01
    for key, paper in numbers.items():
        cells[key].paper = None if paper is None else paper * unit
    return True


def write_table(result: Table, loaded: Loaded, out: Path, band: str, format: str) -> None:
    """table.md (printed), table.csv, plot.png and with latex table.tex into `out`, named by the metric and
    `at` unless the table is of the plan's metric at the final round (table_files); variant.yaml for a
    plan variant."""
    files = table_files(out, result.metric, result.at, loaded.metric, result.target, result.x)
    out.mkdir(parents=True, exist_ok=True)
    markdown = result.markdown()
    write_text_atomically(files["md"], markdown)
    write_text_atomically(files["csv"], result.csv_text())
    plot_curves(result, files["png"], band)
    written = [files["md"], files["csv"], files["png"]]
    if format == "latex":
        write_text_atomically(files["tex"], latex_table(result))
        written.append(files["tex"])
    if result.overrides:
        written.append(write_variant_file(out, result.plan, loaded.plan_files, result.overrides))
    print(markdown, end="")
    print(f"\nwritten: {', '.join(map(str, written))}")


def table_files(out: Path, metric: str, at: str, plan_metric: str, target: Optional[Target] = None,
                x: str = "rounds") -> dict[str, Path]:
    """Extension -> the file of a table of `metric` at `at` in `out`: table.md, ... for the plan's metric
    at the final round, table-<metric>-<at>.md, ... (`last:5` as last5) for any other,
    table-<metric>-to-<value>-<axis>.md for the costs to reach a target, and with curves on a cost axis
    (--x) that axis after the rest (table-test_accuracy-final-grad_evals.md), so that tables of other
    metrics, rounds, targets or axes sit beside each other."""
    if target is not None:
        named = f"{metric}-to-{target.threshold:g}-{target.axis}"
    else:
        named = f"{metric}-{at.replace(':', '')}" + ("" if x == "rounds" else f"-{x}")
    plain = target is None and (metric, at, x) == (plan_metric, "final", "rounds")
    suffix = "" if plain else "-" + re.sub(r"[^A-Za-z0-9_.+=-]+", "-", named)
    return {"md": out / f"table{suffix}.md", "csv": out / f"table{suffix}.csv", "tex": out / f"table{suffix}.tex",
            "png": out / f"plot{suffix}.png"}
