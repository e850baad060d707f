"""A plan's tuning stage: each tuned method's own values chosen per setting on the tuning seeds,
before the plan's own runs train with them (the plan's `tune:`, see plan.py).

    tune:
      seeds: [100]
      select: val_accuracy
      choose_from: all          # optional: all (the default) or finished
      methods:
        FedAvg: {client_optimizer.lr: [0.01, 0.03, 0.1]}

- A cell is a setting and a tuned method. Its tuning runs, one per candidate and tuning seed, are
  grid points 0 to T-1, in runs/<plan>/tune/<setting>/<method>/<candidate>/seed<k>, with the
  validation split that the plan's configs must give them (`data.validation`; a tuned plan without
  one is refused, as is a `select` that the runs do not log, and a tuned setting that does not
  reach the method's runs: check_tuned_settings).
- The choice (selection.py): each candidate's figure is its runs' `select` at `at` (table's --at:
  final, best or last:K) averaged over the tuning seeds; the best figure wins (the lowest for a
  loss), the first candidate in the plan's order on a tie. A candidate with a run that failed in
  the sweep that ran it, diverged or logged no finite value has no figure: it is named, never
  chosen. A cell none of whose candidates has a figure has no choice: its own runs wait.
- A choice is made only once every tuning run of its cell has ended, and from a complete stage: a
  run left unfinished where the stage is known to be over (the final array job of `--slurm`, which
  starts after the tuning job whatever became of it: `--tuning_ended`), cancelled or failed in a
  job, leaves the cell without a choice (its tasks fail, naming it) until a submission finishes
  it; with `choose_from: finished` the choice is made from the candidates whose runs finished, and
  says so. It is made once, under the cell's lock (a second sweep or task finds it made), written
  atomically to runs/<plan>/tune/<setting>/<method>/selection.yaml, and logged in a line.
- The choice enters the plan's own runs of the cell as a mapping after the method's parts, so their
  config records it; their folders stay runs/<plan>/<setting>/<method>/seed<k>, and a run made with
  another choice is another experiment there (refused, as `fit` refuses it).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Optional

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import GridPoint, Plan
from fl_lightning.experiments.plans.resolve import (
    GridResolver,
    ResolvedPoint,
    check_folders,
    describe_point,
    read_states,
    settle_variant,
    value_of,
)
from fl_lightning.experiments.plans.selection import (
    ENDED_UNFINISHED,
    SELECTION_FILE,
    Candidate,
    Cell,
    NotChosen,
    Selection,
    best_candidate,
    describe_at,
    read_selection,
    run_basis,
    write_selection,
)
from fl_lightning.experiments.plans.tune_grid import describe_candidate, same_setting
from fl_lightning.experiments.runs import (
    LOG_FILE,
    PER_CLIENT_METRICS,
    POLL_SECONDS,
    VALIDATION_METRICS,
    RunFolder,
    RunState,
    fit_running_in,
    held_elsewhere,
)
from fl_lightning.file_lock import FileLock, LockHeld

CHOICE_LOCK_FILE = ".selection.lock"
"""Held in a cell's tuning folder while its choice is made: one sweep or array task makes it."""


def choose(plan: Plan, cell: Cell, entries: list[ResolvedPoint], ended: bool, failed: frozenset[int] = frozenset()
           ) -> tuple[Selection, bool]:
    """The cell's choice from its tuning runs (`entries`), written to its selection.yaml, and whether it
    was made here (False: another sweep or task made it first). NotChosen when a run has not ended
    (with `ended`, a run left unfinished and held by no process has), when one ended unfinished and
    the plan chooses from every candidate, or when no candidate has a figure. `failed`: the points
    whose runs failed in this sweep. A tuning folder holding another experiment is refused."""
    states = read_states(entries)
    check_folders(plan.path, entries, states)
    with _held(FileLock(plan.tune_folder(*cell) / CHOICE_LOCK_FILE)):
        made, _ = read_selection(plan, cell, entries)
        if made is not None:
            return made, False
        candidates: dict[str, Candidate] = {}
        unfinished = []
        for entry in entries:
            run, problem = _run_figure(plan, cell, entry, states[entry.point.index], ended,
                                       entry.point.index in failed)
            candidate = candidates.setdefault(repr(entry.point.tuned), Candidate(entry.point.tuned, []))
            candidate.runs.append(run)
            if problem is not None:
                candidate.problem = "; ".join(filter(None, [candidate.problem, problem]))
                if ENDED_UNFINISHED in problem:
                    unfinished.append(entry)
        if unfinished and plan.tune.choose_from == "all":
            raise NotChosen(cell, _incomplete(unfinished, states, len(entries)))
        listed = list(candidates.values())
        chosen = best_candidate(listed, plan.tune.select)
        if chosen is None:
            raise NotChosen(cell, "no candidate has a figure: " + "; ".join(
                f"{describe_candidate(c.values)}: {c.problem}" for c in listed))
        selection = Selection(cell[0], cell[1], plan.tune.select, plan.tune.at, plan.tune.seeds, chosen.values,
                              listed, plan.tune_folder(*cell) / SELECTION_FILE)
        write_selection(plan, selection)
        return selection, True


def _incomplete(unfinished: list[ResolvedPoint], states: dict[int, RunState], size: int) -> str:
    first = unfinished[0].point
    return (f"an incomplete tuning stage: {len(unfinished)} of {size} tuning run(s) {ENDED_UNFINISHED} (cancelled, "
            f"failed or never run), first [{first.index}] {describe_point(first)} in {first.out_dir}: "
            f"{states[first.index].describe()}; submit the plan again to finish them, or choose from the finished "
            "candidates with tune.choose_from: finished")


@contextlib.contextmanager
def _held(lock: FileLock) -> Iterator[None]:
    """The lock, waited for while another process holds it (it makes a choice: an instant)."""
    lock.path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            lock.acquire()
            break
        except LockHeld:
            time.sleep(POLL_SECONDS)
    try:
        yield
    finally:
        lock.release()


def _run_figure(plan: Plan, cell: Cell, entry: ResolvedPoint, state: RunState, ended: bool, failed: bool
                ) -> tuple[dict, Optional[str]]:
    """One tuning run's record (its value of `select` at `at`) and, without a value, why; NotChosen
    while it has not ended."""
    point = entry.point
    record = {"seed": point.seed, "folder": str(point.out_dir), "value": None, **run_basis(entry)}
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
        return record, f"seed {point.seed}: {state.describe()}, {ENDED_UNFINISHED} (cancelled, failed or never run)"
    value = RunFolder(point.out_dir).value(plan.tune.select, plan.tune.at)
    if value is None or not math.isfinite(value):
        return record, f"seed {point.seed}: no finite {plan.tune.select} logged (diverged?)"
    return {**record, "value": value}, None


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


def check_tuned_settings(plan: Plan, tuning: list[ResolvedPoint]) -> None:
    """Refuse a tuned setting that does not reach its method's runs: the tuning runs of a cell on the
    first tuning seed, their configs less the groups that their runs never read (fit.unused_settings),
    hold a single value of it, so that every candidate trains alike and the first wins the tie.
    Comparing what the candidates resolve to, rather than asking the algorithm alone, also refuses a
    setting that anything else leaves alike; the algorithm names what its runs do not read."""
    cells: dict[Cell, list[ResolvedPoint]] = {}
    for entry in tuning:
        if entry.config is not None and entry.point.seed == plan.tune.seeds[0]:
            cells.setdefault(entry.point.cell, []).append(entry)
    for (setting, method), entries in cells.items():
        for key in plan.tune.methods[method]:
            if len({repr(entry.point.tuned[key]) for entry in entries}) < 2:  # one value, or the others refused
                continue
            read = [{group: part for group, part in entry.config.items() if group not in entry.unused}
                    for entry in entries]
            if len({value_of(config, key) for config in read}) > 1:
                continue
            unused = [why for group, why in entries[0].unused.items() if same_setting(group, key)]
            why = (f"the runs of {method} never read it ({unused[0]})" if unused
                   else f"the candidates of {method} resolve to one value of it ({setting})")
            raise ConfigError(f"plan.tune.methods.{method}", "settings that reach the method's runs (one they do "
                              "not read trains every candidate alike, and the first wins the tie)", f"{key}: {why}")


def tuned_grid(plan: Plan) -> TunedGrid:
    """The plan's grid with its tuning stage, in the folders of its variant once its overrides are
    settled (resolve.settle_variant): `TunedGrid.plan` is the plan so named."""
    resolver = GridResolver()
    return TunedGrid(settle_variant(plan, resolver), resolver)


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
        if self.plan.tune is not None:
            check_tuned_settings(self.plan, self.tuning)
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
            # The job's log, not stdout: --mode fit_config's stdout is the config's path alone.
            self.choose(point.cell, ended, log=sys.stderr)
        return [self.resolved[index]]

    def choose(self, cell: Cell, ended: bool, log: Optional[IO[str]] = None) -> Selection:
        """The cell's choice, made (or found made by another sweep or task) and logged in a line to `log`
        (default stdout)."""
        selection, made_here = choose(self.plan, cell, self.cells()[cell], ended, frozenset(self.failed))
        self.made[cell] = selection
        self.stale.pop(cell, None)
        self._regrid()
        print(f"tuning of {cell[1]} | {cell[0]}: chose {selection.describe()}; {selection.path}"
              + ("" if made_here else " (made first by another sweep or task)"), file=log or sys.stdout, flush=True)
        return selection

    def choose_all(self) -> None:
        """The choice of every cell still to choose, the tuning stage over; a cell without one is said."""
        for cell in self.cells():
            if cell in self.made:
                continue
            try:
                self.choose(cell, ended=True)
            except NotChosen as no_choice:
                print(f"tuning of {cell[1]} | {cell[0]}: no choice, its runs wait: {no_choice.reason}",
                      file=sys.stderr, flush=True)

    def describe_cells(self) -> list[str]:
        """A line per cell: its choice, or what it waits for (`sweep --list`); then how many choices are at
        an edge of their grid."""
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
        edges = sum(bool(selection.edges()) for selection in self.made.values())
        if edges:
            lines.append(f"{edges} of {len(self.made)} tuning choice(s) at an edge of their grid (said above): widen "
                         "the grid")
        return lines

    def table_notes(self) -> list[str]:
        """The values chosen, a line per tuned method; the choices made from the finished candidates
        only, or at an edge of their grid; the stale selections."""
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
        for (setting, method), selection in self.made.items():
            remarks = [selection.finished_only()] if selection.from_finished else []
            notes += [f"{method} | {setting}: {remark}" for remark in [*remarks, *selection.edges()]]
        notes += [f"{method} | {setting}: no choice, {reason}" for (setting, method), reason in self.stale.items()]
        return notes

    def _settings(self) -> list[str]:
        return list(dict.fromkeys(setting for setting, _ in self.cells()))
