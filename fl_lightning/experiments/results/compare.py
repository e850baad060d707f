"""`fl-lightning compare`: local runs side by side, as a table and a plot, without W&B.

Runs are read, and their final and best values taken, by the same code as `fl-lightning table`
(`fl_lightning.experiments.runs`, `fl_lightning.metric_names.best_round`): the best of a test metric
is its value at the round of the run's best validation counterpart (val_accuracy for test_accuracy)
when the run has a validation split (data.validation), else the test metric's own best, selected on
the test set; each row gives the round and the metric that selected it, and the notes under the
table say which runs were selected which way. The best of another metric is its maximum, or its
minimum for a metric whose name contains "loss". A torn last line of metrics.jsonl (a killed run,
until it resumes) is left out and reported. A run is named by its method as `fit` names it (the
algorithm's short name, "+const" with FedCONST's constraint), or with `plan` by the plan's name of
the method of its grid point. With `plan`, a run folder that is one of the plan's grid points is
compared with the point's settings, as `fl-lightning table` compares them, and left out and listed
when it was made with other settings; when none of the runs compared is a grid point under
`runs_root` (a wrong or forgotten --runs_root), nothing could be checked, and the comparison is
refused. As in a table, only the points of the runs compared are resolved, and one whose settings
`fit` refuses refuses the plan.

With `baseline` (run folders of one experiment, one run per seed), the runs compared are grouped
into experiments, runs whose settings differ only in the seed (as a W&B group is:
`fl_lightning.run_dir.seedless_digest`), and each group's final and best values are paired by seed
with the baseline's: the mean difference and its 95% confidence interval, as `table --baseline`
shows them (fl_lightning.experiments.results.table_cells.paired_difference_text). A seed whose run and the
baseline's reached different rounds is not paired. Runs of one method under other settings
(another learning rate) are another experiment, paired on its own.

With `x` (a cost axis: samples, grad_evals, upload_bytes, bytes, seconds; cost_axes.py), each row also
says what the run had spent on it by its last round, and the plot draws the metric against it, its x
label saying the unit.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import GridPoint, load_plan
from fl_lightning.experiments.plans.resolve import accepted_config
from fl_lightning.experiments.plans.tuning import TunedGrid
from fl_lightning.experiments.results.cost_axes import axis_label, parse_axis
from fl_lightning.experiments.results.plot import save_laid_out
from fl_lightning.experiments.results.statistics import MIN_PAIRS, paired_difference
from fl_lightning.experiments.results.table_cells import paired_difference_text
from fl_lightning.experiments.runs import RunFolder, axis_value, check_metric, find_runs, run_labels
from fl_lightning.metric_names import TEST_ACCURACY, best_keys, best_round, final_key, is_test_metric, selection_note
from fl_lightning.run_dir import seedless_digest
from fl_lightning.run_logging import METRICS_FILE

Compared = tuple[RunFolder, dict[str, Optional[float]]]
"""A run and its final and best values."""


def compare(runs: Union[list[Path], str], metric: str = TEST_ACCURACY, plot: Optional[Path] = None,
            plan: Optional[Path] = None, runs_root: Path = Path("runs"),
            baseline: Optional[Union[list[Path], str]] = None, x: str = "rounds") -> list[dict]:
    """Print one row per run (its method, rounds done, final and best value of `metric`, the round of
    the best and the metric that selected it) and optionally plot `metric` against the round for
    every run.

    Args:
        runs: output folders of `fl-lightning fit` (each holding metrics.jsonl and config.yaml), as a
            list, one after another (--runs a b) or a glob pattern ("runs/sweep/*"); patterns may
            also be list items.
        metric: a key of metrics.jsonl, e.g. test_accuracy, test_loss, train_loss. The best of a
            test metric is taken at the round of the best validation counterpart (val_accuracy) in
            runs with a validation split, else on the test set itself.
        plot: PNG file to draw the curves into, each labelled by its run folder's name.
        plan: the sweep plan the runs belong to: a run that is one of its grid points and was made with
            other settings than the point's is left out and listed.
        runs_root: the folder holding runs/<plan>/ of the plan.
        baseline: run folders (a list or glob patterns, as `runs`) of one experiment, one run per seed,
            to compare the others with: the runs compared are grouped into experiments (runs whose
            settings differ only in the seed, as a W&B group is), and each group's final and best values
            are paired by seed (its config.yaml's) with the baseline's; printed per group: the mean
            difference and its 95% confidence interval (Student's t, from 3 pairs), * where it excludes 0.
        x: the plot's x axis: rounds, or a cost its rows count (samples, grad_evals, upload_bytes, bytes up and
            down, seconds of the clients' compute); each row then says what the run had spent on it.

    Returns the rows printed.
    """
    parse_axis(x)
    paths = find_runs([runs] if isinstance(runs, (str, Path)) else list(runs), recursive=False)
    if not paths:
        raise ConfigError("runs", "folders written by `fl-lightning fit` (with metrics.jsonl)", str(runs))
    baseline_paths = [] if baseline is None else _run_folders("baseline", baseline)
    expected = _grid_settings(Path(plan), Path(runs_root), paths + baseline_paths) if plan is not None else {}
    comparison = _Comparison()
    for path, label in zip(paths, run_labels(paths)):
        comparison.add(path, label, expected.get(path.resolve()), metric, x)
    check_metric(metric, comparison.read)
    if comparison.left_out:
        print("left out, made with other settings than their grid point's: " + ", ".join(comparison.left_out),
              file=sys.stderr)
    if not comparison.rows:
        raise ConfigError("runs", "runs made with their grid point's settings", str(runs))
    _print_table(comparison.rows)
    for on_validation in (True, False):
        if comparison.selected[on_validation]:
            print(f"{selection_note(metric, on_validation)}: {', '.join(comparison.selected[on_validation])}")
    if baseline is not None:
        print_paired(comparison.compared, _baseline_runs(baseline_paths, expected, metric), metric)
    if plot is not None:
        _plot(comparison.curves, metric, Path(plot), x)
    return comparison.rows


@dataclass
class _Comparison:
    """The runs compared: their rows, curves and values, those read, those left out, and which runs'
    best the validation split selected (True) or the test set (False)."""

    rows: list[dict] = field(default_factory=list)
    curves: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    read: list[RunFolder] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    compared: list[Compared] = field(default_factory=list)
    selected: dict[bool, list[str]] = field(default_factory=lambda: {True: [], False: []})

    def add(self, path: Path, label: str, grid_point: Optional[tuple[str, dict]], metric: str, x: str) -> None:
        """The run in `path`, checked against its grid point's settings when it is one (its method and config),
        its curve on the axis `x`."""
        run = RunFolder(path)
        self.read.append(run)
        if run.torn_line:
            print(f"note: {path}: a torn last line of metrics.jsonl left out (a killed run; resuming it rewrites "
                  "the line)", file=sys.stderr)
        if not run.history:
            raise ConfigError("runs", "folders written by `fl-lightning fit` (with metrics.jsonl)", str(path))
        method, config = grid_point or (run.method, None)
        different = None if config is None else run.difference(config)
        if different is not None:
            self.left_out.append(f"{path} ({different})")
            return
        points, best = run.points_on(x, metric), best_round(run.history, metric)
        spent = {} if x == "rounds" else {x: axis_value(run.history[-1], x)}
        self.rows.append({"run": str(path), "method": method, "rounds": run.rounds_done, **spent,
                          final_key(metric): run.value(metric, "final"),
                          **(dict.fromkeys(best_keys(metric)) if best is None else best.summary())})
        if best is not None and is_test_metric(metric):
            self.selected[best.on_validation].append(label)
        self.compared.append((run, run_values(run, metric)))
        self.curves[label] = points


def run_values(run: RunFolder, metric: str) -> dict[str, Optional[float]]:
    """A run's final and best value of `metric` (None before its first), the best by metric_names' rule."""
    return {at: run.value(metric, at) for at in ("final", "best")}


def _run_folders(field_name: str, given: Union[list[Path], str]) -> list[Path]:
    paths = find_runs([given] if isinstance(given, (str, Path)) else list(given), recursive=False)
    if not paths or not all((path / METRICS_FILE).is_file() for path in paths):
        raise ConfigError(field_name, "folders written by `fl-lightning fit` (with metrics.jsonl)", str(given))
    return paths


def _baseline_runs(paths: list[Path], expected: dict[Path, tuple[str, dict]], metric: str) -> dict[int, Compared]:
    """Seed -> the baseline's run of that seed: runs of one experiment, each made with its grid
    point's settings when it is one."""
    runs = []
    for path in paths:
        _, config = expected.get(path.resolve(), (None, None))
        different = None if config is None else RunFolder(path).difference(config)
        if different is not None:
            raise ConfigError("baseline", "runs made with their grid point's settings", f"{path} ({different})")
        run = RunFolder(path)
        runs.append((run, run_values(run, metric)))
    experiments = experiments_by_seed(runs, "baseline")
    if len(experiments) > 1:
        raise ConfigError("baseline", "the runs of one experiment (settings that differ only in the seed), one per "
                          "seed", "; ".join(_group_label(group) for group in experiments.values()))
    return next(iter(experiments.values()))


def experiments_by_seed(runs: list[Compared], field_name: str) -> dict[str, dict[int, Compared]]:
    """The runs grouped into experiments (by the digest of their settings but the seed: W&B's default
    group), each seed -> its run; two runs of one experiment and seed are refused, naming both."""
    experiments: dict[str, dict[int, Compared]] = {}
    for compared in runs:
        run = compared[0]
        if not isinstance(run.config.get("seed"), int):
            raise ConfigError(field_name, "runs whose config.yaml records their seed (to pair them by seed)",
                              str(run.path))
        group = experiments.setdefault(seedless_digest(run.config), {})
        if run.config["seed"] in group:
            raise ConfigError(field_name, "one run per experiment and seed (two runs of one seed are not two "
                              "seeds)", f"{group[run.config['seed']][0].path} and {run.path}")
        group[run.config["seed"]] = compared
    return experiments


def print_paired(compared: list[Compared], baseline: dict[int, Compared], metric: str) -> None:
    """Each experiment among `compared` minus the baseline, seed by seed, at the final and the best value.
    A seed whose two runs reached different rounds is not paired (their values are of other rounds)."""
    experiments = experiments_by_seed(compared, "runs")
    baseline_digest = seedless_digest(next(iter(baseline.values()))[0].config)
    rows, unequal = [], []
    for digest, group in experiments.items():
        if digest == baseline_digest:
            continue
        at_rounds = {seed: entry for seed, entry in group.items()
                     if seed not in baseline or baseline[seed][0].rounds_done == entry[0].rounds_done}
        unequal += [f"{entry[0].path} (round {entry[0].rounds_done}, the baseline's {baseline[seed][0].rounds_done})"
                    for seed, entry in group.items() if seed not in at_rounds]
        row = {"runs": _group_label(group), "seeds": ", ".join(map(str, sorted(group)))}
        for at in ("final", "best"):
            versus = paired_difference(_values_by_seed(at_rounds, at), _values_by_seed(baseline, at))
            row[f"{at}_{metric} - baseline"] = paired_difference_text(versus, lambda value: f"{value:+.4f}")
        rows.append(row)
    print(f"\nminus the baseline {_group_label(baseline)} (seeds {', '.join(map(str, sorted(baseline)))}), seed by "
          "seed:")
    if rows:
        _print_table(rows)
    else:
        print("(no runs of another experiment than the baseline's)")
    print("the mean over seeds of each run's value minus that of the baseline's run of its seed, with its 95% "
          f"confidence interval (Student's t, n - 1 degrees of freedom) from {MIN_PAIRS} pairs on, * where the "
          "interval excludes 0; with fewer pairs, or seeds without a pair, the mean difference alone and no mark")
    if unequal:
        print("not paired, at other rounds than the baseline's run of its seed: " + ", ".join(unequal))


def _values_by_seed(runs: dict[int, Compared], at: str) -> dict[int, float]:
    return {seed: values[at] for seed, (_, values) in runs.items() if values[at] is not None}


_SEED_FOLDER = re.compile(r"seed\d+")


def _group_label(group: dict[int, Compared]) -> str:
    """`runs/x/fedavg/seed*` for several runs of one folder laid out `<folder>/seed<k>`, else their folders."""
    paths = [run.path for run, _ in group.values()]
    parents = {path.parent for path in paths}
    if len(paths) > 1 and len(parents) == 1 and all(_SEED_FOLDER.fullmatch(path.name) for path in paths):
        return str(parents.pop() / "seed*")
    return ", ".join(map(str, paths))


def _grid_settings(plan: Path, runs_root: Path, runs: list[Path]) -> dict[Path, tuple[str, dict]]:
    """Run folder (resolved) -> the plan's name of its grid point's method and the settings `fit`
    builds for the point, for the folders of `runs` that are grid points of the plan."""
    compared = {path.resolve() for path in runs}
    loaded = load_plan(plan, runs_root=runs_root)
    tuned = TunedGrid(loaded)  # a run of a tuned method is its setting's choice's; one still waiting is none
    grid, resolver = tuned.final_points, tuned.resolver
    points = [point for point in tuned.points if not point.waiting and point.out_dir.resolve() in compared]
    if not points:
        raise ConfigError("runs_root", f"the folder holding the run folders of plan {loaded.name} "
                          f"({runs_root}/{loaded.name}/<setting>/<method>/seed<k>): --plan checks the runs compared "
                          f"that are its grid points, and none of the {len(runs)} is one under it"
                          + _root_of_grid_runs(runs, grid, runs_root), str(runs_root))
    return {point.out_dir.resolve(): (point.method, accepted_config(plan, resolver.resolve(point))) for point in points}


def _root_of_grid_runs(runs: list[Path], grid: list[GridPoint], runs_root: Path) -> str:
    """Where the runs compared that are laid out as grid points of the plan lie, as advice; "" when none is."""
    layouts = {point.out_dir.relative_to(runs_root).parts for point in grid}  # <plan>/<setting>/<method>/seed<k>
    depth = len(next(iter(layouts)))
    roots = sorted({str(path.parents[depth - 1]) for path in map(Path.resolve, runs) if path.parts[-depth:] in layouts})
    return f" (its grid points' folders are under {', '.join(roots)}: give that as --runs_root)" if roots else ""


def _print_table(rows: list[dict]) -> None:
    columns = list(rows[0])
    cells = [[_format(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for line in cells:
        print("  ".join(value.ljust(w) for value, w in zip(line, widths)))


def _format(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _plot(curves: dict[str, list[tuple[float, float]]], metric: str, path: Path, x: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, points in curves.items():
        axes.plot([r for r, _ in points], [v for _, v in points], marker=".", label=name)
    axes.set_xlabel(axis_label(x))
    axes.set_ylabel(metric)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    save_laid_out(figure, path)
