"""A tuning cell's choice as its selection.yaml holds it (tuning.py makes it): every candidate's
figure and runs, the values chosen, the settings it was made from (`basis`: a file of another basis
is stale), and the values chosen at an edge of their grid.

- A candidate's figure is its runs' `select` at `at` averaged over the tuning seeds; the best figure
  wins (the lowest for a loss), the first candidate in the plan's order on a tie.
- A choice is made from a complete tuning stage (every run finished, or failed in the sweep that
  ran it), or, where the plan's `tune.choose_from` is `finished`, from the candidates whose runs
  finished: the file then names the candidates whose runs ended unfinished, and says so.
- A value chosen at the lower or upper end of its setting's values, in a numeric grid of 3 values
  or more, is at an edge of its grid: the best may lie beyond it. With 2 values every choice is at
  an end, which says nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any, Optional

import yaml

from fl_lightning.atomic_files import write_text_atomically
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.overrides import value_text
from fl_lightning.experiments.plans.plan import Plan
from fl_lightning.experiments.plans.resolve import ResolvedPoint
from fl_lightning.experiments.plans.tune_grid import describe_candidate
from fl_lightning.experiments.runs import budget_phrase, parse_at
from fl_lightning.metric_names import best_value, lower_is_better
from fl_lightning.run_dir import experiment_digest
from fl_lightning.yaml_text import load_yaml

SELECTION_FILE = "selection.yaml"
Cell = tuple[str, str]
"""(setting name, method)."""
ENDED_UNFINISHED = "ended unfinished"
"""In the problem of a candidate one of whose tuning runs ended unfinished (cancelled, failed or never run)."""
EDGE_GRID_SIZE = 3
"""The fewest numeric values of a tuned setting whose ends are edges worth a remark."""


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

    @property
    def unfinished(self) -> bool:
        """Whether a run of it ended unfinished where the choice was made from the finished candidates."""
        return self.problem is not None and ENDED_UNFINISHED in self.problem


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

    @property
    def from_finished(self) -> bool:
        """Made from the finished candidates only (tune.choose_from: finished, a run having ended unfinished)."""
        return any(candidate.unfinished for candidate in self.candidates)

    def record(self) -> dict:
        return {"setting": self.setting, "method": self.method, "select": self.select, "at": self.at,
                "seeds": self.seeds, "chosen": self.chosen,
                "chosen_from": "the finished candidates" if self.from_finished else "every candidate",
                **({"edges": self.edges()} if self.edges() else {}),
                "candidates": [{"values": c.values, "figure": c.figure, **({"problem": c.problem} if c.problem else {}),
                                "runs": c.runs} for c in self.candidates]}

    def describe(self) -> str:
        """`client_optimizer.lr=0.5 (val_accuracy 0.4152 at the final round; the others: client_optimizer.lr=0.05:
        0.1003, client_optimizer.lr=0.2: seed 100: failed (its log: ...))`, then what it was chosen from
        when not every candidate, and the edges of its grid."""
        others = [f"{describe_candidate(c.values)}: " + (f"{c.figure:.4g}" if c.problem is None else c.problem)
                  for c in self.candidates if c.values != self.chosen]
        figure = next(c.figure for c in self.candidates if c.values == self.chosen)
        return (f"{describe_candidate(self.chosen)} ({self.select} {figure:.4g} {describe_at(self.at)}"
                + (f"; the others: {', '.join(others)}" if others else "") + ")"
                + (f"; {self.finished_only()}" if self.from_finished else "")
                + "".join(f"; {edge}" for edge in self.edges()))

    def finished_only(self) -> str:
        finished = sum(not candidate.unfinished for candidate in self.candidates)
        return (f"chosen from the finished candidates only ({finished} of {len(self.candidates)}: "
                "tune.choose_from: finished)")

    def edges(self) -> list[str]:
        """`client_optimizer.lr=0.5 is at the upper edge of its grid (0.05 to 0.5): widen it`, per tuned
        setting whose value chosen is the lowest or the highest of 3 numeric values or more."""
        edges = []
        for key, chosen in self.chosen.items():
            given = [candidate.values[key] for candidate in self.candidates]
            if not all(_numeric(value) for value in given) or len(values := sorted(set(given))) < EDGE_GRID_SIZE:
                continue
            edge = {values[0]: "lower", values[-1]: "upper"}.get(chosen)
            if edge is not None:
                edges.append(f"{key}={value_text(chosen)} is at the {edge} edge of its grid ({value_text(values[0])} "
                             f"to {value_text(values[-1])}): widen it")
        return edges


def _numeric(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def describe_at(at: str) -> str:
    """`at the final round`, `at its best evaluation`, `over the last 5 evaluations`."""
    rule, k = parse_at(at)
    return {"final": "at the final round", "best": "at its best evaluation"}.get(
        rule, budget_phrase(at) or f"over the last {k} evaluations")


def basis(plan: Plan, entries: list[ResolvedPoint]) -> dict:
    """What a cell's choice is made from: the tune's rule and seeds, and per candidate its values and
    the settings of its runs (those that define the experiment, the rounds and the evaluation
    cadence); a selection.yaml with another is stale."""
    candidates: dict[str, dict] = {}
    for entry in entries:
        key = repr(entry.point.tuned)
        candidates.setdefault(key, {"values": entry.point.tuned, "runs": []})["runs"].append(run_basis(entry))
    return {"select": plan.tune.select, "at": plan.tune.at, "seeds": plan.tune.seeds,
            "candidates": list(candidates.values())}


def run_basis(entry: ResolvedPoint) -> dict:
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
    and why it is stale (None when there is none, or it is current). A choice made from the finished
    candidates only is stale for a plan that chooses from every candidate."""
    path = plan.tune_folder(*cell) / SELECTION_FILE
    if not path.is_file():
        return None, None
    expected = basis(plan, entries)
    try:
        record = load_yaml(path.read_text())
        recorded = _basis_of(record)
        candidates = [Candidate(c["values"], c["runs"], c.get("problem")) for c in record["candidates"]]
        best = best_candidate(candidates, plan.tune.select)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, TypeError, KeyError, AttributeError,
            statistics.StatisticsError) as err:
        return None, f"{path} is unreadable ({type(err).__name__}: {err})"
    if recorded != load_yaml(yaml.safe_dump(expected)):
        return None, f"{path} is stale: {_stale(recorded, expected)}"
    if best is None or best.values != record.get("chosen"):
        return None, f"{path} is stale: its chosen values are not those of the best of its figures"
    if plan.tune.choose_from == "all" and any(candidate.unfinished for candidate in candidates):
        return None, (f"{path} is stale: made from the finished candidates only, and the plan's tune chooses from "
                      "every candidate (tune.choose_from: all): their tuning runs are finished first")
    return Selection(cell[0], cell[1], plan.tune.select, plan.tune.at, plan.tune.seeds, best.values, candidates,
                     path), None


def best_candidate(candidates: list[Candidate], select: str) -> Optional[Candidate]:
    """The candidate of the best figure (the lowest for a loss), the first in the plan's order on a tie;
    None when none has a figure."""
    scored = [candidate for candidate in candidates if candidate.problem is None]
    if not scored:
        return None
    best = best_value([candidate.figure for candidate in scored], select)
    return next(candidate for candidate in scored if candidate.figure == best)


def write_selection(plan: Plan, selection: Selection) -> None:
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
