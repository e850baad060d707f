"""A plan's tuning stage: each tuned method's own values chosen per setting on the tuning seeds,
before the plan's own runs train with them (the plan's `tune:`, see plan.py).

    tune:
      seeds: [100]
      select: val_accuracy
      methods:
        FedAvg: {client_optimizer.lr: [0.01, 0.03, 0.1]}

- A cell is a setting and a tuned method. Its tuning runs, one per candidate and tuning seed, are
  grid points 0 to T-1, in runs/<plan>/tune/<setting>/<method>/<candidate>/seed<k>, with the
  validation split that the plan's configs must give them (`data.validation`; a tuned plan without
  one is refused, as is a `select` that the runs do not log).
- The choice: each candidate's figure is its runs' `select` at `at` (table's --at: final, best or
  last:K) averaged over the tuning seeds; the best figure wins (the lowest for a loss), the first
  candidate in the plan's order on a tie. A candidate with a run that failed, diverged or logged
  no finite value has no figure: it is named, never chosen. A cell none of whose candidates has a
  figure has no choice: its own runs wait.
- A choice is made only once every tuning run of its cell has ended: finished, or failed where the
  stage is known to be over (a local sweep that ran it, or the final array job of `--slurm`, which
  starts after the tuning job: `--tuning_ended`). It is written, atomically, to
  runs/<plan>/tune/<setting>/<method>/selection.yaml with every candidate's figure and runs, and
  the settings it was made from (`basis`): a plan whose tune grid, select, at or tuning seeds
  changed, or whose tuning runs' settings did, finds it stale and makes it again, never using it.
  Two sweeps making one choice write the same file.
- The choice enters the plan's own runs of the cell as a mapping after the method's parts, so their
  config records it; their folders stay runs/<plan>/<setting>/<method>/seed<k>, and a run made with
  another choice is another experiment there (refused, as `fit` refuses it).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from fl_lightning.atomic_files import write_text_atomically
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.local import (
    LOG_FILE,
    POLL_SECONDS,
    StopRequest,
    fit_running_in,
    held_elsewhere,
    run_locally,
)
from fl_lightning.experiments.machine import SweepOptions
from fl_lightning.experiments.plan import GridPoint, Plan, describe_candidate
from fl_lightning.experiments.resolve import (
    GridResolver,
    ResolvedPoint,
    check_folders,
    describe_point,
    read_states,
    resolve_variant,
)
from fl_lightning.experiments.runs import (
    PER_CLIENT_METRICS,
    VALIDATION_METRICS,
    RunFolder,
    RunState,
    parse_at,
    value_at,
)
from fl_lightning.experiments.slurm import submit
from fl_lightning.metric_names import best_round, best_value, lower_is_better
from fl_lightning.run_dir import experiment_digest
from fl_lightning.yaml_text import load_yaml

SELECTION_FILE = "selection.yaml"
Cell = tuple[str, str]
"""(setting name, method)."""


class NotChosen(ConfigError):
    """A cell's choice cannot be made (yet): a tuning run has not ended, or no candidate has a figure."""

    def __init__(self, cell: Cell, reason: str):
        super().__init__("tune", f"the tuning runs of {cell[1]} | {cell[0]} ended, with a figure to choose by "
                         "(fl-lightning sweep PLAN runs the tuning stage, then the plan's own runs)", reason)
        self.reason = reason


@dataclass
class Candidate:
    values: dict[str, Any]
    runs: list[dict]
    """Per tuning seed: seed, folder, value (None without one) and the settings it was made from."""
    problem: Optional[str] = None
    """Why it has no figure."""

    @property
    def figure(self) -> Optional[float]:
        values = [run["value"] for run in self.runs]
        return None if self.problem is not None else statistics.fmean(values)


@dataclass
class Selection:
    """A cell's choice, as its selection.yaml holds it."""

    setting: str
    method: str
    select: str
    at: str
    seeds: list[int]
    chosen: dict[str, Any]
    candidates: list[Candidate]
    path: Path

    def record(self) -> dict:
        return {"setting": self.setting, "method": self.method, "select": self.select, "at": self.at,
                "seeds": self.seeds, "chosen": self.chosen,
                "candidates": [{"values": c.values, "figure": c.figure, **({"problem": c.problem} if c.problem else {}),
                                "runs": c.runs} for c in self.candidates]}

    def describe(self) -> str:
        """`client_optimizer.lr=0.5 (val_accuracy 0.4152 at the final round; the others: client_optimizer.lr=0.05:
        0.1003, client_optimizer.lr=0.2: seed 100: failed (its log: ...))`."""
        others = [f"{describe_candidate(c.values)}: " + (f"{c.figure:.4g}" if c.problem is None else c.problem)
                  for c in self.candidates if c.values != self.chosen]
        figure = next(c.figure for c in self.candidates if c.values == self.chosen)
        return (f"{describe_candidate(self.chosen)} ({self.select} {figure:.4g} {describe_at(self.at)}"
                + (f"; the others: {', '.join(others)}" if others else "") + ")")


def describe_at(at: str) -> str:
    """`at the final round`, `at its best evaluation`, `over the last 5 evaluations`."""
    rule, k = parse_at(at)
    return {"final": "at the final round", "best": "at its best evaluation"}.get(rule, f"over the last {k} evaluations")


def basis(plan: Plan, entries: list[ResolvedPoint]) -> dict:
    """What a cell's choice is made from: the tune's rule and seeds, and per candidate its values and
    the settings of its runs (those that define the experiment, the rounds and the evaluation
    cadence); a selection.yaml with another is stale."""
    candidates: dict[str, dict] = {}
    for entry in entries:
        key = repr(entry.point.tuned)
        candidates.setdefault(key, {"values": entry.point.tuned, "runs": []})["runs"].append(_run_basis(entry))
    return {"select": plan.tune.select, "at": plan.tune.at, "seeds": plan.tune.seeds,
            "candidates": list(candidates.values())}


def _run_basis(entry: ResolvedPoint) -> dict:
    config = entry.config or {}
    federation = config.get("federation") or {}
    return {"seed": entry.point.seed, "experiment": experiment_digest(config) if config else None,
            "rounds": federation.get("rounds"), "eval_every": federation.get("eval_every")}


def _basis_of(record: dict) -> dict:
    """The basis a selection.yaml was made from."""
    keys = ("seed", "experiment", "rounds", "eval_every")
    return {"select": record.get("select"), "at": record.get("at"), "seeds": record.get("seeds"),
            "candidates": [{"values": c.get("values"), "runs": [{k: run.get(k) for k in keys} for run in c["runs"]]}
                           for c in record.get("candidates") or []]}


def _stale(recorded: dict, expected: dict) -> str:
    """What differs between a selection's basis and the one expected (they differ), in a few words."""
    for key, what in (("select", "select"), ("at", "at"), ("seeds", "tuning seeds")):
        if recorded[key] != expected[key]:
            return f"made with {what} {recorded[key]}, the plan's tune says {expected[key]}"
    values = [[c["values"] for c in basis["candidates"]] for basis in (recorded, expected)]
    if values[0] != values[1]:
        return (f"made from the candidates {', '.join(map(describe_candidate, values[0]))}, the plan's tune has "
                f"{', '.join(map(describe_candidate, values[1]))}")
    return "made from tuning runs of other settings (the plan's configs, a setting or the method changed since)"


def read_selection(plan: Plan, cell: Cell, entries: list[ResolvedPoint]) -> tuple[Optional[Selection], Optional[str]]:
    """The cell's selection.yaml when it holds a choice made from `entries` as they are now (else None),
    and why it is stale (None when there is none, or it is current)."""
    path = plan.tune_folder(*cell) / SELECTION_FILE
    if not path.is_file():
        return None, None
    expected = basis(plan, entries)
    try:
        record = load_yaml(path.read_text())
        recorded = _basis_of(record)
        candidates = [Candidate(c["values"], c["runs"], c.get("problem")) for c in record["candidates"]]
        best = best_candidate(candidates, plan.tune.select)
    except (OSError, yaml.YAMLError, TypeError, KeyError, AttributeError, statistics.StatisticsError) as err:
        return None, f"{path} is unreadable ({type(err).__name__}: {err})"
    if recorded != load_yaml(yaml.safe_dump(expected)):
        return None, f"{path} is stale: {_stale(recorded, expected)}"
    if best is None or best.values != record.get("chosen"):
        return None, f"{path} is stale: its chosen values are not those of the best of its figures"
    return Selection(cell[0], cell[1], plan.tune.select, plan.tune.at, plan.tune.seeds, best.values, candidates,
                     path), None


def choose(plan: Plan, cell: Cell, entries: list[ResolvedPoint], ended: bool, failed: frozenset[int] = frozenset()
           ) -> Selection:
    """The cell's choice from its tuning runs (`entries`), written to its selection.yaml; NotChosen when
    a run has not ended (with `ended`, a run left unfinished and held by no process has: it failed or
    was stopped) or no candidate has a figure. `failed`: the points whose runs failed in this sweep. A
    tuning folder holding another experiment is refused."""
    states = read_states(entries)
    check_folders(plan.path, entries, states)
    candidates: dict[str, Candidate] = {}
    for entry in entries:
        run, problem = _run_figure(plan, cell, entry, states[entry.point.index], ended, entry.point.index in failed)
        candidate = candidates.setdefault(repr(entry.point.tuned), Candidate(entry.point.tuned, []))
        candidate.runs.append(run)
        if problem is not None:
            candidate.problem = "; ".join(filter(None, [candidate.problem, problem]))
    listed = list(candidates.values())
    chosen = best_candidate(listed, plan.tune.select)
    if chosen is None:
        raise NotChosen(cell, "no candidate has a figure: " + "; ".join(
            f"{describe_candidate(c.values)}: {c.problem}" for c in listed))
    selection = Selection(cell[0], cell[1], plan.tune.select, plan.tune.at, plan.tune.seeds, chosen.values, listed,
                          plan.tune_folder(*cell) / SELECTION_FILE)
    _write(plan, selection)
    return selection


def best_candidate(candidates: list[Candidate], select: str) -> Optional[Candidate]:
    """The candidate of the best figure (the lowest for a loss), the first in the plan's order on a tie;
    None when none has a figure."""
    scored = [candidate for candidate in candidates if candidate.problem is None]
    if not scored:
        return None
    best = best_value([candidate.figure for candidate in scored], select)
    return next(candidate for candidate in scored if candidate.figure == best)


def _run_figure(plan: Plan, cell: Cell, entry: ResolvedPoint, state: RunState, ended: bool, failed: bool
                ) -> tuple[dict, Optional[str]]:
    """One tuning run's record (its value of `select` at `at`) and, without a value, why; NotChosen
    while it has not ended."""
    point = entry.point
    record = {"seed": point.seed, "folder": str(point.out_dir), "value": None, **_run_basis(entry)}
    holder = held_elsewhere(point.out_dir)
    if holder is not None and state.finished:
        # Another sweep holds a finished run's folder for an instant, to look at it (a sweep never
        # trains a finished run again): the run is over once the fit that finished it has exited.
        holder = fit_running_in(point.out_dir)
    if holder is not None:
        raise NotChosen(cell, f"[{point.index}] {describe_point(point)} is running (held by {holder})")
    if failed:
        return record, f"seed {point.seed}: failed (its log: {point.out_dir / LOG_FILE})"
    if not state.finished:
        if not ended:
            raise NotChosen(cell, f"[{point.index}] {describe_point(point)} in {point.out_dir} is {state.describe()}")
        return record, f"seed {point.seed}: {state.describe()}, ended unfinished (failed, stopped or never run)"
    value = run_value(RunFolder(point.out_dir), plan.tune.select, plan.tune.at)
    if value is None or not math.isfinite(value):
        return record, f"seed {point.seed}: no finite {plan.tune.select} logged (diverged?)"
    return {**record, "value": value}, None


def run_value(run: RunFolder, metric: str, at: str) -> Optional[float]:
    """The run's value of `metric` at `at`, as `table --at` takes it: its final value, the mean of its
    last K, or its best (a validation metric is its own best: fl_lightning.metric_names.best_round)."""
    if parse_at(at)[0] == "best":
        best = best_round(run.history, metric)
        return None if best is None else best.value
    return value_at([value for _, value in run.points(metric)], at)


def _write(plan: Plan, selection: Selection) -> None:
    rule = (f"the best {plan.tune.select} ({'lowest' if lower_is_better(plan.tune.select) else 'highest'}) "
            f"{describe_at(plan.tune.at)}, the mean over the tuning seeds, the first candidate on a tie")
    header = (f"# The tuning choice of {selection.method} | {selection.setting} in plan {plan.name}: {rule}.\n"
              "# Written by fl-lightning sweep once every tuning run of the cell had ended; a change of the\n"
              "# plan's tune or of its tuning runs' settings makes it stale, and the sweep makes it again.\n")
    text = yaml.dump(selection.record(), Dumper=_Dumper, sort_keys=False, default_flow_style=None)
    write_text_atomically(selection.path, header + text)


class _Dumper(yaml.SafeDumper):
    """Writes a value that appears twice (the chosen values, a candidate's) twice, not as an alias."""

    def ignore_aliases(self, data) -> bool:
        return True


def check_tuning(plan: Plan, tuning: list[ResolvedPoint]) -> None:
    """Refuse a tuned plan whose tuning runs hold out no validation split, or do not log its `select`
    (a point `fit` refuses is left to the check of the grid)."""
    if plan.tune is None:
        return
    resolved = [entry for entry in tuning if entry.config is not None]
    without = [entry for entry in resolved if not entry.config["data"]["validation"]]
    if without:
        raise ConfigError("plan.tune", "tuning runs that hold out a validation split to choose on (data.validation "
                          "in the plan's configs, e.g. {data.validation: 0.2}: the test set chooses nothing)",
                          f"{len(without)} of {len(tuning)} without one, first [{without[0].point.index}] "
                          f"{describe_point(without[0].point)}: data.validation null")
    per_client = all(entry.config["data"]["per_client_eval"] for entry in resolved)
    logged = [*VALIDATION_METRICS, *(PER_CLIENT_METRICS if per_client else ())]
    if plan.tune.select not in logged:
        raise ConfigError("plan.tune.select", f"a validation metric the tuning runs log ({', '.join(logged)}): the "
                          "choice is made on the validation split", plan.tune.select)


def tuned_grid(plan: Plan) -> TunedGrid:
    """The plan's grid with its tuning stage, in the folders of its variant once its overrides are
    settled (resolve.resolve_variant)."""
    resolver = GridResolver()
    resolve_variant(plan, resolver)
    return TunedGrid(plan, resolver)


@dataclass
class TunedGrid:
    """A plan's grid points with their tuning stage: the tuning points (0 to T-1), then the plan's own,
    a tuned method's with its cell's choice, or `waiting`. Final points are resolved as they are asked
    for (a table resolves those with runs only)."""

    plan: Plan
    resolver: GridResolver = field(default_factory=GridResolver)
    tuning: list[ResolvedPoint] = field(init=False)
    made: dict[Cell, Selection] = field(init=False, default_factory=dict)
    stale: dict[Cell, str] = field(init=False, default_factory=dict)
    """Cells whose selection.yaml is stale or unreadable: why."""
    failed: set[int] = field(init=False, default_factory=set)
    """Tuning points whose run failed in this sweep."""
    final_points: list[GridPoint] = field(init=False)
    """The plan's own runs, with the choices made (Plan.grid)."""

    def __post_init__(self):
        self.tuning = [self.resolver.resolve(point) for point in self.plan.tuning_grid()]
        check_tuning(self.plan, self.tuning)
        for cell, entries in self.cells().items():
            selection, stale = read_selection(self.plan, cell, entries)
            if selection is not None:
                self.made[cell] = selection
            if stale is not None:
                self.stale[cell] = stale
        self._regrid()

    def _regrid(self) -> None:
        self.final_points = self.plan.grid({cell: selection.chosen for cell, selection in self.made.items()})

    def cells(self) -> dict[Cell, list[ResolvedPoint]]:
        """Every cell of the tuning stage and its tuning points, in grid order."""
        cells: dict[Cell, list[ResolvedPoint]] = {}
        for entry in self.tuning:
            cells.setdefault(entry.point.cell, []).append(entry)
        return cells

    @property
    def points(self) -> list[GridPoint]:
        return [*(entry.point for entry in self.tuning), *self.final_points]

    @property
    def resolved(self) -> list[ResolvedPoint]:
        """Every point resolved, index-aligned; a waiting one at its first candidate (for the checks
        and the estimate only)."""
        return [*self.tuning, *self.final()]

    def final(self) -> list[ResolvedPoint]:
        return [self.resolver.resolve(point) for point in self.final_points]

    def tuning_to_run(self) -> list[ResolvedPoint]:
        """The tuning points of the cells still to choose, but those that failed in this sweep."""
        return [entry for entry in self.tuning if entry.point.cell not in self.made and entry.point.index not in
                self.failed]

    def to_run(self, index: Optional[int], ended: bool) -> list[ResolvedPoint]:
        """What a sweep would run: the tuning points of the cells still to choose and the plan's own
        runs that have their choice; with `index`, that point alone, a waiting one after its cell's
        choice is made (NotChosen while it cannot be). An array task (--index) so reads its own run
        folder only (and its cell's tuning runs, for a choice to make): reading every checkpoint of
        the grid in every task would cost far more than the task's start."""
        for cell, reason in self.stale.items():
            print(f"note: the selection of {cell[1]} | {cell[0]}: {reason}; it is made again once its tuning runs "
                  "end", file=sys.stderr, flush=True)
        if index is None:
            return [*self.tuning_to_run(), *(entry for entry in self.final() if not entry.point.waiting)]
        point = self.points[index]
        if point.waiting:
            self.choose(point.cell, ended)
        return [self.resolved[index]]

    def choose(self, cell: Cell, ended: bool) -> Selection:
        selection = choose(self.plan, cell, self.cells()[cell], ended, frozenset(self.failed))
        self.made[cell] = selection
        self.stale.pop(cell, None)
        self._regrid()
        return selection

    def choose_all(self) -> None:
        """The choice of every cell still to choose, the tuning stage over; a cell without one is said."""
        for cell in self.cells():
            if cell in self.made:
                continue
            try:
                selection = self.choose(cell, ended=True)
            except NotChosen as no_choice:
                print(f"tuning of {cell[1]} | {cell[0]}: no choice, its runs wait: {no_choice.reason}",
                      file=sys.stderr, flush=True)
                continue
            print(f"tuning of {cell[1]} | {cell[0]}: chose {selection.describe()}; {selection.path}", flush=True)

    def describe_cells(self) -> list[str]:
        """A line per cell: its choice, or what it waits for (`sweep --list`)."""
        lines = []
        for cell, entries in self.cells().items():
            if cell in self.made:
                lines.append(f"tuning of {cell[1]} | {cell[0]}: chose {self.made[cell].describe()}")
                continue
            states = read_states(entries)
            done = sum(state.finished for state in states.values())
            stale = f" ({self.stale[cell]})" if cell in self.stale else ""
            lines.append(f"tuning of {cell[1]} | {cell[0]}: no choice yet{stale}, {done} of {len(entries)} tuning "
                         "run(s) finished")
        return lines

    def table_notes(self) -> list[str]:
        """The values chosen, a line per tuned method, and the stale selections."""
        if self.plan.tune is None:
            return []
        tune, notes = self.plan.tune, []
        for method in tune.methods:
            made = [(setting, selection) for (setting, other), selection in self.made.items() if other == method]
            if not made:
                continue
            choices = {describe_candidate(selection.chosen) for _, selection in made}
            chosen = (f"{choices.pop()} in every setting" if len(choices) == 1 and len(made) == len(self._settings())
                      else ", ".join(f"{describe_candidate(s.chosen)} ({setting})" for setting, s in made))
            notes.append(f"tuned {method} on seed(s) {', '.join(map(str, tune.seeds))} by the best {tune.select} "
                         f"{describe_at(tune.at)} (every candidate's figure in "
                         f"{self.plan.tune_folder('<setting>', method) / SELECTION_FILE}): {chosen}")
        notes += [f"{method} | {setting}: no choice, {reason}" for (setting, method), reason in self.stale.items()]
        return notes

    def _settings(self) -> list[str]:
        return list(dict.fromkeys(setting for setting, _ in self.cells()))


def run_tuning_stage(grid: TunedGrid, options: SweepOptions) -> int:
    """Locally: every tuning run of the cells still to choose, until each has finished or failed here
    (a run that another sweep holds is waited for, then taken when left unfinished), then every
    cell's choice. The stage's exit status: 1 when a tuning run failed, 128 + N when signal N
    stopped it (nothing is chosen then)."""
    for cell, selection in grid.made.items():
        print(f"tuning of {cell[1]} | {cell[0]}: chose {describe_candidate(selection.chosen)} already "
              f"({selection.path}); its tuning runs are not run again", flush=True)
    status = 0
    while pending := grid.tuning_to_run():
        print(f"tuning stage: {len(pending)} tuning run(s) of {len({e.point.cell for e in pending})} cell(s)",
              flush=True)
        outcome = run_locally(pending, read_states(pending), options, on_terminal=False)
        if outcome.interrupted or options.dry_run:
            return outcome.status
        status = max(status, outcome.status)
        grid.failed |= {point.index for point in outcome.failed}
        if not outcome.elsewhere:
            break
        stopped = _wait_for(outcome.elsewhere)
        if stopped:
            return stopped
    grid.choose_all()
    return status


def _wait_for(points: list[GridPoint]) -> int:
    """Wait until no other process holds these run folders; 128 + N when signal N came first, else 0."""
    print(f"waiting for {len(points)} tuning run(s) running elsewhere before choosing: "
          + ", ".join(f"[{point.index}]" for point in points), flush=True)
    with StopRequest().installed() as stop:
        while any(held_elsewhere(point.out_dir) for point in points) and not stop.signals:
            time.sleep(POLL_SECONDS)
    if stop.signals:
        print(f"interrupted by {stop.signals[0].name} while waiting for the tuning runs elsewhere: run the same "
              "command again to continue", file=sys.stderr, flush=True)
        return 128 + stop.signals[0]
    return 0


def submit_stages(plan_path: Path, grid: TunedGrid, options: SweepOptions) -> None:
    """With --slurm: the tuning points of the cells still to choose as one array job, then the plan's
    own runs as a second, which starts once the first has ended (afterany: a failed candidate is
    named, not chosen) and whose tasks each make their cell's choice first (--tuning_ended)."""
    final = [point.index for point in grid.final_points]
    tuning = [entry.point.index for entry in grid.tuning_to_run()]
    if not tuning:
        submit(plan_path, final, options)
        return
    job = submit(plan_path, tuning, options, what="tuning runs")
    submit(plan_path, final, options, after=job or "TUNING_JOB_ID", tuning_ended=True)
