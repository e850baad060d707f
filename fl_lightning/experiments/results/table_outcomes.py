"""What becomes of each run a table expects: one `Verdict` from one function (`judge`), why it is or is
not counted and its value, and the notes under the table that the verdicts come to (`Outcomes`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Optional

from fl_lightning.experiments.results.cost_axes import Target
from fl_lightning.experiments.results.table_sources import Entry
from fl_lightning.experiments.runs import RunFolder
from fl_lightning.metric_names import best_round, is_test_metric, selection_note
from fl_lightning.run_dir import CONFIG_FILE


class Outcome(Enum):
    """What a run the table expects comes to: counted (with its value, or pending or empty without one),
    or why it is not."""

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


class Note(Enum):
    """A note under the table and the runs it lists, in the order the notes are printed (NOTES words them)."""

    EXCLUDED = auto()
    PARTIAL = auto()
    EARLY = auto()
    OTHER_SETTINGS = auto()
    TORN = auto()
    CHOSEN_ON_VALIDATION = auto()
    CHOSEN_ON_TEST = auto()
    UNCHECKED = auto()
    NOT_STARTED = auto()
    WITHOUT_ROWS = auto()
    PENDING = auto()
    EMPTY = auto()
    NOT_REACHED = auto()
    TARGET_MISSED = auto()
    WAITING = auto()


NOTES = {
    Note.EXCLUDED: "not counted, unfinished (--include_partial true counts them): {runs}",
    Note.PARTIAL: "counted although unfinished: {runs}",
    Note.EARLY: "finished early (a final stop in its checkpoint), counted at its last round: {runs}",
    Note.OTHER_SETTINGS: "not counted, made with other settings than the plan's (rerun them in folders of their "
                         "own): {runs}",
    Note.TORN: "a torn last line of metrics.jsonl left out (a killed run; resuming it rewrites the line): {runs}",
    Note.CHOSEN_ON_VALIDATION: "{on_validation}: {count} run(s)",
    Note.CHOSEN_ON_TEST: "{on_test}: {runs}",
    Note.UNCHECKED: "read as they recorded themselves, not checked against the plan's settings ({module} is not "
                    "importable here: with its folder on PYTHONPATH they are): {runs}",
    Note.NOT_STARTED: "not started: {runs}",
    Note.WITHOUT_ROWS: "{runs}: no metrics rows (checkpoint at round {round}): resume it to rewrite them "
                       "(fl-lightning fit --config {config})",
    Note.PENDING: "pending, no {metric} logged yet (its evaluations are to come): {runs}",
    Note.EMPTY: "no {metric} logged: {runs}",
    Note.NOT_REACHED: "not reached, no value: their evaluations of {metric} end short of --at's budget (or they "
                      "logged no cost counters): {runs}",
    Note.TARGET_MISSED: "never reached the target, counted in their cells as not reached (no evaluation of {metric} "
                        "met --target): {runs}",
    Note.WAITING: "not counted, waiting for the tuning stage to choose their values (fl-lightning sweep runs it, "
                  "then them): {runs}",
}
"""How each note reads: {runs} lists its runs (cut at twenty), {metric} is the table's; a note whose runs
differ in another field ({module}, {round}) is one note for each value of it."""


@dataclass(frozen=True)
class Listed:
    """A run a note lists: how it shows in the listing, and the note's other fields that it gives."""

    entry: Entry
    shown: str
    fields: tuple[tuple[str, object], ...] = ()


@dataclass
class Verdict:
    """What a run the table expects comes to."""

    entry: Entry
    outcome: Outcome
    run: Optional[RunFolder] = None
    value: Optional[float] = None
    """Its value of the metric (in the metric's units), where counted and logged."""
    points: list[tuple[float, float]] = field(default_factory=list)
    """Its curve of the metric, on the table's x axis (rounds, or a cost: --x)."""
    detail: object = None
    """The checkpoint's round (WITHOUT_ROWS), or the settings that differ (OTHER_SETTINGS)."""
    unfinished: Optional[str] = None
    """A counted run short of its rounds: "partial" (--include_partial) or "early" (a final stop)."""
    under_way: bool = False
    """Its rounds are not all logged: a missing value is still to come."""
    on_validation: Optional[bool] = None
    """For --at best of a test metric: whether the validation split chose its round."""
    reached: bool = True
    """For --at AXIS=BUDGET: whether its evaluations reach the budget (`RunFolder.reaches`)."""
    missed_target: bool = False
    """For --target: its evaluations never met the target (`Target.missed`); its cell counts it as not reached."""


def judge(entry: Entry, metric: str, at: str, include_partial: bool, x: str = "rounds",
          target: Optional[Target] = None) -> Verdict:
    """The one rule of what a table does with a run: counts it, and with which value (with a `target`, its
    cost to reach it), or says why not; its curve on the axis `x`."""
    if entry.point is not None and entry.point.waiting:
        return Verdict(entry, Outcome.WAITING)
    run = RunFolder(entry.path)
    if not run.history:
        checkpoint = run.state(None).round
        outcome = Outcome.NOT_STARTED if checkpoint is None else Outcome.WITHOUT_ROWS
        return Verdict(entry, outcome, run, detail=checkpoint)
    different = None if entry.config is None else run.difference(entry.config)
    if different is None and entry.rounds is not None and run.rounds_done > entry.rounds:
        different = f"federation.rounds: it logged round {run.rounds_done}, past the {entry.rounds} of the plan"
    if different is not None:
        return Verdict(entry, Outcome.OTHER_SETTINGS, run, detail=different)
    rounds = entry.rounds or run.rounds_planned
    under_way, unfinished = rounds is None or run.rounds_done < rounds, None
    # An early stop is final only by its checkpoint's word: a row count cannot tell it from a kill.
    if under_way and rounds is not None and run.state(rounds).finished:
        under_way, unfinished = False, "early"
    elif under_way:
        if not include_partial:
            return Verdict(entry, Outcome.EXCLUDED, run)
        unfinished = "partial"
    verdict = Verdict(entry, Outcome.COUNTED, run, points=run.points_on(x, metric), unfinished=unfinished,
                      under_way=under_way, reached=run.reaches(metric, at),
                      value=run.value(metric, at) if target is None else target.cost(run),
                      missed_target=target is not None and target.missed(run))
    best = best_round(run.history, metric) if at == "best" and is_test_metric(metric) else None
    if best is not None:
        verdict.on_validation = best.on_validation
    return verdict


@dataclass
class Outcomes:
    """What became of the runs a table expects, besides the values counted: the runs each note lists (`of` the
    runs' verdicts), and the notes."""

    listed: dict[Note, list[Listed]] = field(default_factory=dict)

    @classmethod
    def of(cls, verdicts: list[Verdict]) -> "Outcomes":
        outcomes = cls()
        for verdict in verdicts:
            outcomes.add(verdict)
        return outcomes

    def runs(self, note: Note) -> list[Entry]:
        return [listed.entry for listed in self.listed.get(note, [])]

    def shown(self, note: Note) -> list[str]:
        return [listed.shown for listed in self.listed.get(note, [])]

    def _list(self, note: Note, entry: Entry, shown: Optional[str] = None, **fields) -> None:
        self.listed.setdefault(note, []).append(Listed(entry, shown or _where(entry), tuple(fields.items())))

    def add(self, verdict: Verdict) -> None:
        entry, run = verdict.entry, verdict.run
        if run is not None and run.torn_line:
            self._list(Note.TORN, entry)
        if entry.unimportable is not None:
            self._list(Note.UNCHECKED, entry, module=entry.unimportable)
        if verdict.outcome is Outcome.WITHOUT_ROWS:
            self._list(Note.WITHOUT_ROWS, entry, round=verdict.detail, config=entry.path / CONFIG_FILE)
        elif verdict.outcome is Outcome.OTHER_SETTINGS:
            self._list(Note.OTHER_SETTINGS, entry, f"{_where(entry)} ({verdict.detail})")
        elif verdict.outcome is Outcome.EXCLUDED:
            self._list(Note.EXCLUDED, entry, _progress(entry, run))
        elif verdict.outcome is not Outcome.COUNTED:
            self._list(Note[verdict.outcome.name], entry)  # WAITING, NOT_STARTED: a note of the same name
        if verdict.outcome is not Outcome.COUNTED:
            return
        if verdict.unfinished is not None:
            self._list(Note.EARLY if verdict.unfinished == "early" else Note.PARTIAL, entry, _progress(entry, run))
        if verdict.on_validation is not None:
            self._list(Note.CHOSEN_ON_VALIDATION if verdict.on_validation else Note.CHOSEN_ON_TEST, entry)
        if verdict.missed_target:
            self._list(Note.TARGET_MISSED, entry)
        elif verdict.value is None:
            self._list(Note.PENDING if verdict.under_way else Note.EMPTY if verdict.reached else Note.NOT_REACHED,
                       entry)

    def cells_under_way(self) -> set[tuple[str, str]]:
        """The cells with runs still training that a value of theirs may yet fill."""
        return {(entry.method, entry.setting) for note in (Note.PENDING, Note.EXCLUDED, Note.WAITING)
                for entry in self.runs(note)}

    def notes(self, metric: str) -> list[str]:
        """The notes, in NOTES' order: one for each note with runs (one for each value of its other fields)."""
        notes = []
        for note in Note:
            by_fields: dict[tuple, list[str]] = {}
            for listed in self.listed.get(note, []):
                by_fields.setdefault(listed.fields, []).append(listed.shown)
            for fields_given, shown in by_fields.items():
                notes.append(NOTES[note].format(
                    runs=_listing(shown), count=len(shown), metric=metric, **dict(fields_given),
                    on_validation=selection_note(metric, on_validation=True),
                    on_test=selection_note(metric, on_validation=False)))
        return notes


def _where(entry: Entry) -> str:
    return f"{entry.setting}/{entry.method}/seed{entry.seed}"


def _progress(entry: Entry, run: RunFolder) -> str:
    return f"{_where(entry)} (round {run.rounds_done}/{entry.rounds or run.rounds_planned or '?'})"


def _listing(items: list[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
