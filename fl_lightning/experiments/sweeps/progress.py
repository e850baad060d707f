"""Where a sweep is: each run's round and the training left at the pace of the rounds it logged
(`runs.Pace`: metrics.jsonl's round_seconds and eval_seconds), for `sweep --mode list`, which reads the run
folders wherever they ran (SLURM's tasks too), and for the progress lines of a local sweep.

A run without a timed round of its own is counted at the mean pace of the runs of its method that
have one, else of all that have one; the pace leaves checkpoints out, and counts the rounds a run
has yet to train from its last round logged. A local sweep knows more: how long each run it finished
took from its process's start to its exit. What that holds besides the run's rounds at their pace
(the interpreter's start, imports, data loading, the first round's warm-up, checkpoints, the exit;
`ProgressLines.run_ended`) is added, at the mean of the runs finished so far, to each run that has
yet to start or to log its first round: on a plan of short runs it is most of the time left.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from fl_lightning.experiments.plans.plan import GridPoint
from fl_lightning.experiments.runs import Pace, RunFolder
from fl_lightning.run_logging import METRICS_FILE

PROGRESS_SECONDS = 15.0
"""A local sweep prints a progress line when a run logged a round, at most this often."""
CHECK_SECONDS = 1.0
"""How often a local sweep looks at its running runs' metrics.jsonl."""


@dataclass
class RunLeft:
    """A run that has rounds to train."""

    method: str
    rounds_left: int
    seconds_per_round: Optional[float]
    """Its own pace, if it logged a timed round."""
    starting: bool = False
    """It has yet to start, or to log its first round: what a run takes besides its rounds is ahead of it."""


def seconds_left(runs: list[RunLeft], besides_rounds: float = 0.0) -> Optional[float]:
    """The time left in all of `runs`, one after another: their rounds left at their pace, and
    `besides_rounds` seconds for each starting run; None when none has a timed round."""
    by_method: dict[str, list[float]] = {}
    for run in runs:
        if run.seconds_per_round is not None:
            by_method.setdefault(run.method, []).append(run.seconds_per_round)
    if not by_method:
        return None
    overall = [seconds for paces in by_method.values() for seconds in paces]
    return sum(run.rounds_left * (run.seconds_per_round if run.seconds_per_round is not None
                                  else statistics.fmean(by_method.get(run.method, overall)))
               + (besides_rounds if run.starting else 0.0) for run in runs)


def duration(seconds: Optional[float]) -> str:
    """`under 1 s`, `40 s`, `12 min`, `3.4 h`, `2.1 days`; `-` for None."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return "under 1 s"
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 100 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


class ProgressLines:
    """A local sweep's progress, a line at a time so that its log reads as well as its terminal: the
    runs finished of all, each running run's round and time left, and the sweep's (its runs' rounds
    left, and what the runs it finished took besides their rounds for each run yet to start, shared
    between its `jobs`)."""

    def __init__(self, rounds: dict[int, int], start_rounds: dict[int, int], jobs: int, total: int,
                 clock: Callable[[], float] = time.monotonic, then: Sequence[RunLeft] = ()):
        self.rounds = rounds
        self.start_rounds = start_rounds
        """Index -> the round a run starts from (its checkpoint's)."""
        self.then = list(then)
        """The runs of the sweep's next stage (the plan's own runs after its tuning stage), in its time left."""
        self.jobs, self.total, self.clock = jobs, total, clock
        self.paces: dict[int, Pace] = {}
        self.methods: dict[int, str] = {}
        self.sizes: dict[int, int] = {}
        self.besides_rounds: dict[int, float] = {}
        """Index -> the seconds a finished run took besides its rounds at its pace."""
        self.checked = self.printed = -math.inf
        self.news = False
        """A running run logged a round that no line has shown yet."""

    def line(self, running: list[GridPoint], pending: list[GridPoint], finished: int, failed: int) -> Optional[str]:
        """A progress line when a running run has logged its first round, or has logged rounds not yet
        shown and the last line is PROGRESS_SECONDS old; else None (the runs' metrics are looked at
        every CHECK_SECONDS)."""
        now = self.clock()
        if now - self.checked < CHECK_SECONDS:
            return None
        self.checked = now
        first = False
        for point in running:
            before, after = self.paces.get(point.index), self._read(point)
            first = first or (before is None and after is not None)
            self.news = self.news or (after is not None and (before is None or after.round > before.round))
        if not (first or (self.news and now - self.printed >= PROGRESS_SECONDS)):
            return None
        self.printed, self.news = now, False
        return self.describe(running, pending, finished, failed)

    def describe(self, running: list[GridPoint], pending: list[GridPoint], finished: int, failed: int) -> str:
        shown = []
        for point in running:
            pace = self.paces.get(point.index)
            left = None if pace is None else pace.seconds_left(self.rounds[point.index])
            shown.append(f"[{point.index}] round {self._reached(point)}/{self.rounds[point.index]} "
                         f"({duration(left)} left)")
        to_train = {point.index for point in [*running, *pending]}
        # Runs done meanwhile give their method's pace to its runs yet to start.
        done = [RunLeft(self.methods[index], 0, pace.seconds_per_round) for index, pace in self.paces.items()
                if index not in to_train]
        besides = statistics.fmean(self.besides_rounds.values()) if self.besides_rounds else 0.0
        left = [*done, *(self._run_left(point) for point in [*running, *pending]), *self.then]
        total = seconds_left(left, besides)
        notes = [*([f"with the {len(self.then)} run(s) of its next stage"] if self.then else []),
                 *(["their rounds alone until a run has finished"]
                   if total is not None and not self.besides_rounds and any(run.starting for run in left) else [])]
        return (f"progress: {finished}/{self.total} runs finished" + (f", {failed} failed" if failed else "")
                + (f"; running {', '.join(shown)}" if shown else "")
                + f"; the sweep: {duration(None if total is None else total / self.jobs)} left"
                + (f" ({'; '.join(notes)})" if notes else ""))

    def run_ended(self, point: GridPoint, seconds: float) -> None:
        """The sweep's run of `point` finished, `seconds` after its process started: what it took besides
        the rounds it trained, at the pace of its metrics.jsonl read to the end, counts for the runs to start."""
        self.sizes.pop(point.index, None)
        pace = self._read(point)
        if pace is None or pace.seconds_per_round is None:
            return
        trained = pace.round - self.start_rounds.get(point.index, 0)
        self.besides_rounds[point.index] = max(seconds - trained * pace.seconds_per_round, 0.0)

    def _read(self, point: GridPoint) -> Optional[Pace]:
        """The run's pace, read again when its metrics.jsonl changed size."""
        try:
            size = (point.out_dir / METRICS_FILE).stat().st_size
        except OSError:
            return None
        if self.sizes.get(point.index) != size:
            self.sizes[point.index] = size
            pace = RunFolder(point.out_dir).pace
            if pace is not None:
                self.paces[point.index], self.methods[point.index] = pace, point.method
        return self.paces.get(point.index)

    def _reached(self, point: GridPoint) -> int:
        pace = self.paces.get(point.index)
        return self.start_rounds.get(point.index, 0) if pace is None else pace.round

    def _run_left(self, point: GridPoint) -> RunLeft:
        """The point's rounds to train, at its pace or, before its first round, its method's."""
        pace = self.paces.get(point.index)
        return RunLeft(point.method, max(self.rounds[point.index] - self._reached(point), 0),
                       None if pace is None else pace.seconds_per_round, starting=pace is None)
