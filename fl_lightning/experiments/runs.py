"""Reading a run folder written by `fl-lightning fit`: its config, its metrics, its state, and whether it
holds the experiment asked for. One reader for `fl-lightning sweep` (what to skip, resume or start),
`table` and `compare`; nothing here writes.

- metrics.jsonl may end in a torn line: a run killed while appending leaves one until it resumes
  (the resume rewrites the file from its checkpoint). That line is left out and reported
  (`RunFolder.torn_line`); an unreadable line before the last is no kill's doing and is refused, naming
  the file and the line.
- A run is over when its newest good checkpoint reached the rounds asked for or records a final
  stop (an early stop that a rerun keeps): `fl_lightning.checkpoint.run_is_over`.
- A folder holds another experiment when its checkpoint or config.yaml differs from the settings
  asked for in a setting that defines the experiment: the check `fit` makes before it resumes
  (`fl_lightning.run_dir.check_same_experiment`), made here before any run starts.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fl_lightning.algorithms import Algorithm
from fl_lightning.checkpoint import load_checkpoint, resume_candidates, run_is_over
from fl_lightning.configurable import resolve_dotted_path
from fl_lightning.errors import ConfigError
from fl_lightning.fit import method_name
from fl_lightning.metric_names import (
    CLIENT_VAL_ACCURACY_MEAN,
    CLIENT_VAL_ACCURACY_MIN,
    CLIENT_VAL_ACCURACY_P10,
    CLIENT_VAL_ACCURACY_STD,
    COST_CLIENT_SECONDS,
    COST_COUNTERS,
    COST_DOWNLOAD_BYTES,
    COST_GRAD_EVALS,
    COST_SAMPLES,
    COST_UPLOAD_BYTES,
    PARTICIPATION_METRICS,
    TEST_ACCURACY,
    TEST_LOSS,
    VAL_ACCURACY,
    VAL_LOSS,
    best_round,
)
from fl_lightning.run_dir import CONFIG_FILE, DifferentExperiment, RunDirLock, check_same_experiment, recorded_config
from fl_lightning.run_logging import METRICS_FILE

LOG_FILE = "sweep.log"
"""Each local run's output, in its run folder (appended to by every attempt)."""
SWEEP_LOCK_FILE = ".sweep.lock"
"""Held in a run folder by the sweep that runs it."""
POLL_SECONDS = 0.1
"""How often a process waiting on a run folder (its lock, its process) looks again, in seconds."""


class RunFolder:
    """A folder written by `fl-lightning fit`, read as it is asked for: its config.yaml (`config`),
    the rows of its metrics.jsonl (`history`, `torn_line`), its pace, its state as `fit --resume auto`
    would find it (`state`), and what makes it another experiment than a config (`difference`). The
    one reader of run folders, for `sweep`, `table`, `compare` and the tuning stage."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @functools.cached_property
    def config(self) -> dict:
        """config.yaml, or {} where there is none."""
        config = recorded_config(self.path)
        return config if isinstance(config, dict) else {}

    @functools.cached_property
    def _rows(self) -> tuple[list[dict], bool]:
        return read_metric_rows(self.path)

    @property
    def history(self) -> list[dict]:
        """metrics.jsonl's rows, one per round (a torn last line left out)."""
        return self._rows[0]

    @property
    def torn_line(self) -> bool:
        """metrics.jsonl ended in a partial line (left out of `history`)."""
        return self._rows[1]

    @property
    def rounds_done(self) -> int:
        return self.history[-1]["round"] if self.history else 0

    @property
    def rounds_planned(self) -> Optional[int]:
        return (self.config.get("federation") or {}).get("rounds")

    @property
    def method(self) -> str:
        """The run's method as `fit` named it (`fl_lightning.fit.method_name`), from its config.yaml; an
        algorithm whose class cannot be imported here is named by its class name."""
        algorithm = self.config.get("algorithm") or {}
        class_path = algorithm.get("class_path", "?") if isinstance(algorithm, dict) else str(algorithm)
        try:
            algorithm_class = resolve_dotted_path(class_path)
        except (ValueError, ImportError, AttributeError):
            algorithm_class = None
        if isinstance(algorithm_class, type) and issubclass(algorithm_class, Algorithm):
            name = algorithm_class.method_name()
        else:
            name = class_path.rsplit(".", 1)[-1]
        return method_name(name, constrained=self.config.get("constraint") is not None)

    def points(self, metric: str) -> list[tuple[int, float]]:
        """(round, value) of every row that logged `metric`."""
        return [(row["round"], row[metric]) for row in self.history if row.get(metric) is not None]

    def value(self, metric: str, at: str) -> Optional[float]:
        """The run's value of `metric` at `at` (AT_CHOICES), as `table --at`, the tuning choice and
        `compare` all take it: the last logged, the mean of the last K logged, or the best by
        fl_lightning.metric_names.best_round (a test metric at its validation counterpart's best round
        when the run holds out a validation split); None before its first."""
        budget = parse_budget(at)
        if budget is not None:
            within = [value for spent, value in self.points_on(budget[0], metric) if spent <= budget[1]]
            return within[-1] if within and self.reaches(metric, at) else None
        if parse_at(at)[0] == "best":
            best = best_round(self.history, metric)
            return None if best is None else best.value
        return value_at([value for _, value in self.points(metric)], at)

    def points_on(self, axis: str, metric: str) -> list[tuple[float, float]]:
        """(what the run had spent on `axis` (BUDGET_AXES), value) of every row that logged `metric` and
        the axis's counters."""
        return [(spent, row[metric]) for row in self.history
                if row.get(metric) is not None and (spent := axis_value(row, axis)) is not None]

    def reaches(self, metric: str, at: str) -> bool:
        """Whether its evaluations of `metric` reach `at`'s budget (AXIS=BUDGET): its last is at or past it,
        so that its last within it is its value there; any other `at` is reached."""
        budget = parse_budget(at)
        if budget is None:
            return True
        points = self.points_on(budget[0], metric)
        return bool(points) and points[-1][0] >= budget[1]

    def metrics_logged(self) -> set[str]:
        return {key for row in self.history for key, value in row.items() if value is not None} - {"round"}

    def metrics_to_come(self) -> set[str]:
        """What its config has it log at the evaluations it has not reached yet (every run evaluates
        after its last round), and before its first round what every round logs, its cost counters and
        who took part (a run resumed from a checkpoint written before the counters existed logs none of
        them): none once it has logged its last round, or without a config."""
        if self.rounds_planned is None or self.rounds_done >= self.rounds_planned:
            return set()
        data = self.config.get("data") or {}
        validation = VALIDATION_METRICS + (PER_CLIENT_METRICS if data.get("per_client_eval") else ())
        per_round = () if self.history else (*COST_COUNTERS, *PARTICIPATION_METRICS)
        return {*EVALUATION_METRICS, *per_round, *(validation if data.get("validation") else ())}

    @property
    def pace(self) -> Optional[Pace]:
        """How far metrics.jsonl got and how fast its rounds went; None without a row, or with an
        unreadable line before the last (which `table` refuses)."""
        try:
            rows = self.history
        except ConfigError:
            return None
        if not rows:
            return None
        timed = [row["round_seconds"] + (row.get("eval_seconds") or 0) for row in rows
                 if isinstance(row.get("round_seconds"), (int, float))]
        return Pace(round=rows[-1]["round"],
                    seconds_per_round=statistics.fmean(timed[1:] or timed) if timed else None)

    def state(self, rounds: Optional[int]) -> RunState:
        """Its checkpoints read newest first, as `--resume auto` reads them, for a run of `rounds`
        rounds (None: unknown); trains nothing."""
        candidates = resume_candidates(self.path)
        started = (self.path / CONFIG_FILE).is_file()
        pace = self.pace if started else None
        for path in candidates:
            try:
                state = load_checkpoint(path)
            except ValueError:
                continue
            return RunState(round=state["round"], rounds=rounds, started=started,
                            finished=rounds is not None and state["round"] <= rounds and run_is_over(state, rounds),
                            hyperparameters=state["hyperparameters"], pace=pace)
        problem = "unusable: every checkpoint fails its checks" if candidates else None
        return RunState(round=None, rounds=rounds, started=started, problem=problem, pace=pace)

    def difference(self, config: dict, state: Optional[RunState] = None) -> Optional[str]:
        """What makes the run another experiment than `config` (the settings `fit` builds), as `fit`
        would refuse it (`data.alpha 0.5 -> 0.1 (config.yaml)`); None when it is the same one (or there
        is no run yet). Compared: the newest checkpoint's settings when `state` holds them, and config.yaml."""
        rounds = config["federation"]["rounds"]
        if state is not None and state.round is not None and state.round > rounds:
            return f"federation.rounds: the checkpoint reached round {state.round}, past the {rounds} asked for"
        records = [(recorded_config(self.path), CONFIG_FILE)]
        if state is not None and state.hyperparameters is not None:
            records.insert(0, (state.hyperparameters, f"the checkpoint of round {state.round}"))
        for recorded, source in records:
            if recorded is None:
                continue
            try:
                check_same_experiment(recorded, config, source, self.path)
            except DifferentExperiment as different:
                return f"{different.fields()} ({source})"
        return None


EVALUATION_METRICS = (TEST_ACCURACY, TEST_LOSS, "eval_seconds")
"""What every evaluation logs (fl_lightning.callbacks.Evaluate: each eval_every rounds, and after the last)."""
VALIDATION_METRICS = (VAL_ACCURACY, VAL_LOSS)
"""What it adds with a validation split (data.validation)."""
PER_CLIENT_METRICS = (CLIENT_VAL_ACCURACY_MEAN, CLIENT_VAL_ACCURACY_STD, CLIENT_VAL_ACCURACY_MIN,
                      CLIENT_VAL_ACCURACY_P10)
"""What it adds with data.per_client_eval."""


def check_metric(metric: str, runs: list[RunFolder]) -> None:
    """Refuse a metric that none of `runs` logged, nor will log at an evaluation to come (while a sweep
    runs, before the first evaluation, the metrics to come are all there is); nothing is refused
    while no run has logged a round."""
    logged = set().union(*(run.metrics_logged() for run in runs))
    to_come = set().union(*(run.metrics_to_come() for run in runs)) - logged
    if logged and metric not in logged | to_come:
        runs_log = "the runs logged" + (" or will log at their evaluations to come" if to_come else "")
        raise ConfigError("metric", f"a metric {runs_log}: {', '.join(sorted(logged | to_come))}", metric)


def read_metric_rows(out_dir: Path) -> tuple[list[dict], bool]:
    """The rows of out_dir/metrics.jsonl (none if absent), and whether a torn last line was left out."""
    path = Path(out_dir) / METRICS_FILE
    if not path.is_file():
        return [], False
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("round"), int):
            rows.append(row)
        elif number == len(lines):
            return rows, True
        else:
            raise ConfigError("runs", f"{METRICS_FILE} of one JSON object per round (only a last line torn by a "
                              "killed run is left out)", f"{path}, line {number}")
    return rows, False


@dataclass
class Pace:
    """How far a run's metrics.jsonl got, and how fast its rounds went."""

    round: int
    """The last round logged."""
    seconds_per_round: Optional[float]
    """The mean of its rounds' round_seconds and eval_seconds (the first round's warm-up left out when
    there are others); None when no row has them. Checkpoints are not in it."""

    def seconds_left(self, rounds: int) -> Optional[float]:
        if self.seconds_per_round is None:
            return None
        return max(rounds - self.round, 0) * self.seconds_per_round


@dataclass
class RunState:
    """A run folder as `fit --resume auto` would find it."""

    round: Optional[int]
    """Round of the newest checkpoint that passes its checks; None: there is none."""
    rounds: Optional[int]
    """Rounds asked for; None when unknown (the point's settings are refused)."""
    started: bool
    """The run wrote its config.yaml (it got as far as training)."""
    finished: bool = False
    """The newest good checkpoint reached `rounds` or records a final stop: `fit` would train nothing."""
    hyperparameters: Optional[dict] = None
    """The settings the newest good checkpoint records."""
    problem: Optional[str] = None
    pace: Optional[Pace] = None
    """What metrics.jsonl says of the run's rounds (a running run logs rounds past its checkpoint)."""

    @property
    def round_logged(self) -> Optional[int]:
        """The furthest round the run reached: its metrics' or its checkpoint's."""
        rounds = [r for r in (self.round, None if self.pace is None else self.pace.round) if r is not None]
        return max(rounds, default=None)

    @property
    def seconds_left(self) -> Optional[float]:
        """At the pace of the rounds it logged; None when finished, or without a timed round."""
        if self.finished or self.rounds is None or self.pace is None:
            return None
        return self.pace.seconds_left(self.rounds)

    @property
    def stopped_early(self) -> bool:
        return self.finished and self.rounds is not None and self.round < self.rounds

    def describe(self) -> str:
        if self.problem is not None:
            return self.problem
        if self.stopped_early:
            return f"finished, stopped early at round {self.round}/{self.rounds}"
        if self.finished:
            return "finished"
        if self.round is not None:
            return f"partial at round {self.round}" + (f"/{self.rounds}" if self.rounds is not None else "")
        return "started, no checkpoint yet" if self.started else "not started"


BUDGET_AXES = {"rounds": ("round",), "samples": (COST_SAMPLES,), "grad_evals": (COST_GRAD_EVALS,),
               "upload_bytes": (COST_UPLOAD_BYTES,), "bytes": (COST_UPLOAD_BYTES, COST_DOWNLOAD_BYTES),
               "seconds": (COST_CLIENT_SECONDS,)}
"""The axes a run's value can be taken at (`--at AXIS=BUDGET`): the metrics rows' keys each sums."""
AT_CHOICES = ("final, best, last:K (the mean of the last K evaluations, K >= 1) or AXIS=BUDGET (the last evaluation "
              f"within a budget > 0 of {', '.join(BUDGET_AXES)}, e.g. grad_evals=2e6)")


def parse_budget(at: str) -> Optional[tuple[str, float]]:
    """"grad_evals=2e6" -> ("grad_evals", 2e6); None for an `at` that is no budget."""
    axis, is_budget, budget = at.partition("=")
    if not is_budget:
        return None
    try:
        value = float(budget)
    except ValueError:
        value = math.nan
    if axis not in BUDGET_AXES or not 0 < value < math.inf:
        raise ConfigError("at", AT_CHOICES, at)
    return axis, value


def budget_phrase(at: str) -> Optional[str]:
    """How a caption says an AXIS=BUDGET `at` ("at the last evaluation within grad_evals = 2e+06"); None
    for another `at`."""
    budget = parse_budget(at)
    return None if budget is None else f"at the last evaluation within {budget[0]} = {budget[1]:g}"


def axis_value(row: dict, axis: str) -> Optional[float]:
    """What a metrics row says the run had spent on `axis` by its end; None in a row without its counters."""
    keys = BUDGET_AXES[axis]
    return None if any(row.get(key) is None for key in keys) else sum(row[key] for key in keys)


def parse_at(at: str) -> tuple[str, int]:
    """"final" -> ("final", 1), "best" -> ("best", 0), "last:5" -> ("last", 5), "grad_evals=2e6" ->
    ("budget", 0)."""
    if parse_budget(at) is not None:
        return "budget", 0
    if at == "final":
        return "final", 1
    if at == "best":
        return "best", 0
    match = re.fullmatch(r"last:(\d+)", at)
    if match and int(match.group(1)) >= 1:
        return "last", int(match.group(1))
    raise ConfigError("at", AT_CHOICES, at)


def value_at(values: list[float], at: str) -> Optional[float]:
    """One run's final value (the last logged) or the mean of its last k (`last:k`), from its values in
    round order. `best` is chosen by round, by fl_lightning.metric_names.best_round, from the run's rows."""
    rule, k = parse_at(at)
    if rule == "best":
        raise ValueError("value_at takes final or last:K; a run's best is metric_names.best_round of its rows")
    return statistics.fmean(values[-k:]) if values else None


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


def fit_running_in(out_dir: Path) -> Optional[str]:
    """Who runs `fit` in the run folder (the run's own lock, which fit holds from its start until it
    exits), or None."""
    return RunDirLock(out_dir).holder()


def held_elsewhere(out_dir: Path) -> Optional[str]:
    """Who holds the run folder (`pid 1234 on host`: another sweep, or a `fit`), or None; asked without
    taking the folder, so that sweeps asking at once never take each other for its holder."""
    if not out_dir.is_dir():
        return None
    return RunDirLock(out_dir, SWEEP_LOCK_FILE).holder() or fit_running_in(out_dir)
