"""What becomes of each run a table expects: one `Verdict` from one function (`judge`), why it is or is
not counted and its value, and the notes under the table that the verdicts come to (`Outcomes`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from fl_lightning.experiments.results.table_sources import Entry
from fl_lightning.experiments.runs import RunFolder
from fl_lightning.metric_names import best_round, is_test_metric, selection_note
from fl_lightning.run_dir import CONFIG_FILE

WAITING = "waiting"
"""A run of a tuned method whose setting has no tuning choice yet (tuning.py): neither resolved nor read."""
NOT_STARTED = "not started"
WITHOUT_ROWS = "without rows"
"""No metrics rows, but a checkpoint (rows lost to a kill between checkpoint and log)."""
OTHER_SETTINGS = "other settings"
"""Made with other settings than its grid point's."""
EXCLUDED = "excluded"
"""Unfinished, left out (no --include_partial)."""
COUNTED = "counted"
"""Its value counted (or, without one yet, pending or empty)."""


@dataclass
class Verdict:
    """What a run the table expects comes to."""

    entry: Entry
    outcome: str
    run: Optional[RunFolder] = None
    value: Optional[float] = None
    """Its value of the metric (in the metric's units), where counted and logged."""
    points: list[tuple[int, float]] = field(default_factory=list)
    """Its curve of the metric."""
    detail: object = None
    """The checkpoint's round (WITHOUT_ROWS), or the settings that differ (OTHER_SETTINGS)."""
    unfinished: Optional[str] = None
    """A counted run short of its rounds: "partial" (--include_partial) or "early" (a final stop)."""
    under_way: bool = False
    """Its rounds are not all logged: a missing value is still to come."""
    on_validation: Optional[bool] = None
    """For --at best of a test metric: whether the validation split chose its round."""


def judge(entry: Entry, metric: str, at: str, include_partial: bool) -> Verdict:
    """The one rule of what a table does with a run: counts it, and with which value, or says why not."""
    if entry.point is not None and entry.point.waiting:
        return Verdict(entry, WAITING)
    run = RunFolder(entry.path)
    if not run.history:
        checkpoint = run.state(None).round
        return Verdict(entry, NOT_STARTED if checkpoint is None else WITHOUT_ROWS, run, detail=checkpoint)
    different = None if entry.config is None else run.difference(entry.config)
    if different is None and entry.rounds is not None and run.rounds_done > entry.rounds:
        different = f"federation.rounds: it logged round {run.rounds_done}, past the {entry.rounds} of the plan"
    if different is not None:
        return Verdict(entry, OTHER_SETTINGS, run, detail=different)
    rounds = entry.rounds or run.rounds_planned
    under_way, unfinished = rounds is None or run.rounds_done < rounds, None
    # An early stop is final only by its checkpoint's word: a row count cannot tell it from a kill.
    if under_way and rounds is not None and run.state(rounds).finished:
        under_way, unfinished = False, "early"
    elif under_way:
        if not include_partial:
            return Verdict(entry, EXCLUDED, run)
        unfinished = "partial"
    verdict = Verdict(entry, COUNTED, run, points=run.points(metric), value=run.value(metric, at),
                      unfinished=unfinished, under_way=under_way)
    best = best_round(run.history, metric) if at == "best" and is_test_metric(metric) else None
    if best is not None:
        verdict.on_validation = best.on_validation
    return verdict


@dataclass
class Outcomes:
    """What became of the runs a table expects, besides the values counted: the notes under it (`of` the
    runs' verdicts)."""

    not_started: list[Entry] = field(default_factory=list)
    without_rows: list[tuple[Entry, int]] = field(default_factory=list)
    """No metrics rows, and a checkpoint of that round (rows lost to a kill between checkpoint and log)."""
    excluded: list[tuple[Entry, RunFolder]] = field(default_factory=list)
    """Unfinished, left out (no --include_partial)."""
    partial: list[tuple[Entry, RunFolder]] = field(default_factory=list)
    early: list[tuple[Entry, RunFolder]] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    """Runs made with other settings than their point's, each with the fields that differ."""
    torn: list[Entry] = field(default_factory=list)
    chosen_on_validation: list[Entry] = field(default_factory=list)
    chosen_on_test: list[Entry] = field(default_factory=list)
    pending: list[Entry] = field(default_factory=list)
    """Counted although unfinished, but with no value of the metric yet: its evaluations are to come."""
    empty: list[Entry] = field(default_factory=list)
    waiting: list[Entry] = field(default_factory=list)
    """Runs of a tuned method whose setting has no tuning choice yet (tuning.py)."""
    unchecked: list[Entry] = field(default_factory=list)
    """Runs read as they recorded themselves: their point names a module this process cannot import."""

    @classmethod
    def of(cls, verdicts: list[Verdict]) -> "Outcomes":
        outcomes = cls()
        for verdict in verdicts:
            outcomes.add(verdict)
        return outcomes

    def add(self, verdict: Verdict) -> None:
        entry, run = verdict.entry, verdict.run
        if run is not None and run.torn_line:
            self.torn.append(entry)
        if entry.unimportable is not None:
            self.unchecked.append(entry)
        if verdict.outcome != COUNTED:
            {WAITING: lambda: self.waiting.append(entry), NOT_STARTED: lambda: self.not_started.append(entry),
             WITHOUT_ROWS: lambda: self.without_rows.append((entry, verdict.detail)),
             OTHER_SETTINGS: lambda: self.other.append(f"{_where(entry)} ({verdict.detail})"),
             EXCLUDED: lambda: self.excluded.append((entry, run))}[verdict.outcome]()
            return
        if verdict.unfinished is not None:
            (self.early if verdict.unfinished == "early" else self.partial).append((entry, run))
        if verdict.on_validation is not None:
            (self.chosen_on_validation if verdict.on_validation else self.chosen_on_test).append(entry)
        if verdict.value is None:
            (self.pending if verdict.under_way else self.empty).append(entry)

    def cells_under_way(self) -> set[tuple[str, str]]:
        """The cells with runs still training that a value of theirs may yet fill."""
        return {(entry.method, entry.setting) for entry in [*self.pending, *(e for e, _ in self.excluded),
                                                            *self.waiting]}

    def notes(self, metric: str) -> list[str]:
        notes = []
        if self.excluded:
            notes.append("not counted, unfinished (--include_partial true counts them): "
                         + _listing([_progress(e, r) for e, r in self.excluded]))
        if self.partial:
            notes.append("counted although unfinished: " + _listing([_progress(e, r) for e, r in self.partial]))
        if self.early:
            notes.append("finished early (a final stop in its checkpoint), counted at its last round: "
                         + _listing([_progress(e, r) for e, r in self.early]))
        if self.other:
            notes.append("not counted, made with other settings than the plan's (rerun them in folders of their "
                         "own): " + _listing(self.other))
        if self.torn:
            notes.append("a torn last line of metrics.jsonl left out (a killed run; resuming it rewrites the line): "
                         + _listing([_where(e) for e in self.torn]))
        if self.chosen_on_validation:
            notes.append(f"{selection_note(metric, on_validation=True)}: {len(self.chosen_on_validation)} run(s)")
        if self.chosen_on_test:
            notes.append(f"{selection_note(metric, on_validation=False)}: "
                         + _listing([_where(e) for e in self.chosen_on_test]))
        for module in sorted({entry.unimportable for entry in self.unchecked}):
            notes.append(f"read as they recorded themselves, not checked against the plan's settings ({module} is not "
                         "importable here: with its folder on PYTHONPATH they are): "
                         + _listing([_where(e) for e in self.unchecked if e.unimportable == module]))
        if self.not_started:
            notes.append("not started: " + _listing([_where(e) for e in self.not_started]))
        notes += [f"{_where(entry)}: no metrics rows (checkpoint at round {checkpoint}): resume it to rewrite them "
                  f"(fl-lightning fit --config {entry.path / CONFIG_FILE})" for entry, checkpoint in self.without_rows]
        if self.pending:
            notes.append(f"pending, no {metric} logged yet (its evaluations are to come): "
                         + _listing([_where(e) for e in self.pending]))
        if self.empty:
            notes.append(f"no {metric} logged: " + _listing([_where(e) for e in self.empty]))
        if self.waiting:
            notes.append("not counted, waiting for the tuning stage to choose their values (fl-lightning sweep runs "
                         "it, then them): " + _listing([_where(e) for e in self.waiting]))
        return notes


def _where(entry: Entry) -> str:
    return f"{entry.setting}/{entry.method}/seed{entry.seed}"


def _progress(entry: Entry, run: RunFolder) -> str:
    return f"{_where(entry)} (round {run.rounds_done}/{entry.rounds or run.rounds_planned or '?'})"


def _listing(items: list[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
