"""Callbacks: everything a run does around its rounds, as small separate pieces.

The loop (`fl_lightning.federation.train`) calls these hooks on every rank through Fabric's
`engine.call` (the Fabric object of the run), in the order the callbacks are listed:

- `on_fit_start(engine, loop)`: once, before the first round (also after a resume).
- `on_round_start(engine, loop, round_index)`: before the round's clients train.
- `on_client_end(engine, loop, client, uploads, weight)`: on the rank that trained it, after each
  client's update: `client` is its `ClientRound` (id, round, global parameters), `uploads` its
  flat upload vectors by name (read only), `weight` its aggregation weight p_i. A diagnostic sums
  what it needs here and reduces it once on its own rounds.
- `on_round_end(engine, loop, metrics)`: after the server step; `metrics` (a dict with "round",
  the 1-based number of the round just completed) may be extended in place, and is the row that
  metrics.jsonl, W&B and the checkpoint record.
- `on_fit_end(engine, loop)`: once, after the last round, a stop, or a failure (`loop.failed`, and
  `loop.failure` the exception that ended the run).

To stop a run, a hook calls `loop.request_stop(reason)`. Requests ride the stop slot of the next
aggregation, so every rank agrees without a collective of its own: a request made in
`on_round_start` stops the run after that round, one made in `on_round_end` after the next. The
run then saves a checkpoint and ends cleanly. A stop is final by default (a decision, such as
EarlyStopping's): the checkpoint records it, and the same command run again trains nothing more.
`loop.request_stop(reason, final=False)` is an interruption instead (TimeBudget; a signal), which
the same command resumes.

A callback that keeps state across rounds returns it from `state_dict()` and takes it back in
`load_state_dict()`: it is saved with every checkpoint (rank 0's) and restored on resume before
`on_fit_start`, so an interrupted run behaves as an uninterrupted one. The state holds only what
the run built; the callback's arguments are its configuration, given again by the resumed run's
config, and the same as the run's: a resume that gives a callback the run had another value for
an argument is refused as another experiment would be (EarlyStopping's patience changes what the
run computes), but for the arguments its class lists in `safe_to_change` (those that only change
how the run is carried out: TimeBudget's `max_seconds`, a diagnostic's `every`). A callback's
state is matched to it by its position and class name among the run's callbacks (`callback_key`),
so a resumed run keeps its callbacks in their order (new ones after them).

A user adds callbacks in the config: `callbacks: [{class_path: my_module.MyCallback, init_args: {...}}]`.
"""

from __future__ import annotations

import sys
import time
from typing import Literal, Optional

from fl_lightning.cluster import STOP_SIGNALS, requeue_after_stop
from fl_lightning.configurable import Configurable
from fl_lightning.errors import ConfigError, WriteFailed
from fl_lightning.metric_names import TEST_ACCURACY
from fl_lightning.run_logging import MetricsLog, WandbRun, round_line, summary_line


class Callback(Configurable):
    """Base class: override the hooks you need (each does nothing by default), and `state_dict` /
    `load_state_dict` when the callback keeps state across rounds."""

    safe_to_change: tuple[str, ...] = ()
    """The arguments a resumed run may give other values: those that change neither the model nor
    what the rows of the run record (a subclass lists its own; every other argument must stay)."""

    def state_dict(self) -> dict:
        """What this callback built during the run and needs after a resume (not its arguments),
        as values `torch.save` writes (tensors come back on the CPU); empty when it keeps nothing."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what `state_dict` returned, from the checkpoint the run resumes."""
        if state:
            raise TypeError(f"{type(self).__name__} saved its state ({', '.join(sorted(state))}) but has no "
                            "load_state_dict to restore it")

    def on_fit_start(self, engine, loop) -> None:
        pass

    def on_round_start(self, engine, loop, round_index: int) -> None:
        pass

    def on_client_end(self, engine, loop, client, uploads: dict, weight: float) -> None:
        pass

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        pass

    def on_fit_end(self, engine, loop) -> None:
        pass


def callback_key(position: int, callback: Callback) -> str:
    """What a callback's saved state is filed under: its position among the run's callbacks and its
    class name, e.g. "1:EarlyStopping" (the run's own Evaluate is 0)."""
    return f"{position}:{type(callback).__name__}"


def callback_states(callbacks: list[Callback]) -> dict[str, dict]:
    """The state of every callback that has one, by `callback_key`."""
    states = {callback_key(position, callback): callback.state_dict() for position, callback in enumerate(callbacks)}
    return {key: state for key, state in states.items() if state}


def load_callback_states(callbacks: list[Callback], states: dict[str, dict], source: str) -> None:
    """Give each callback its saved state. A saved state without its callback (removed, moved or
    replaced by another) is refused: dropping it would silently change what the run does."""
    by_key = {callback_key(position, callback): callback for position, callback in enumerate(callbacks)}
    for key, state in states.items():
        if key not in by_key:
            position, name = key.split(":", 1)
            raise ConfigError("callbacks", f"{name} at position {position} of the run's callbacks, whose state "
                              f"{source} holds (a resumed run keeps its callbacks in their order; add new ones after "
                              "them)", ", ".join(by_key))
        by_key[key].load_state_dict(state)


class EarlyStopping(Callback):
    """Stops the run for good (a final stop: running the command again trains nothing more) when
    `metric` has not improved by more than `min_delta` for `patience` evaluations. The metric must
    be one every rank computes alike (reduced across ranks, as train_loss and test_accuracy are).
    Its state, the best value so far and the evaluations since, is saved with the checkpoints."""

    def __init__(self, metric: str = TEST_ACCURACY, mode: Literal["max", "min"] = "max", patience: int = 5,
                 min_delta: float = 0.0):
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.best: Optional[float] = None
        self.evaluations_without_improvement = 0

    def state_dict(self) -> dict:
        return {"best": self.best, "evaluations_without_improvement": self.evaluations_without_improvement}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.evaluations_without_improvement = state["best"], state["evaluations_without_improvement"]

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        value = metrics.get(self.metric)
        if value is None:
            return
        if self.best is None or (value - self.best if self.mode == "max" else self.best - value) > self.min_delta:
            self.best, self.evaluations_without_improvement = value, 0
            return
        self.evaluations_without_improvement += 1
        if self.evaluations_without_improvement >= self.patience:
            loop.request_stop(f"early stopping: {self.metric} has not improved for {self.patience} evaluations",
                              final=True)


class TimeBudget(Callback):
    """Interrupts the run (with a checkpoint; the same command resumes it) before a round that would
    end past `max_seconds` of this process's training time, judged by the longest round of the run so
    far: its state, so that a resumed process judges its first round by it too. The budget may
    change on resume: it only chooses where the run is interrupted."""

    safe_to_change = ("max_seconds",)

    def __init__(self, max_seconds: float):
        self.max_seconds = max_seconds
        self._started: Optional[float] = None
        self._longest_round = 0.0
        self._round_started = 0.0

    def state_dict(self) -> dict:
        return {"longest_round_seconds": self._longest_round}

    def load_state_dict(self, state: dict) -> None:
        self._longest_round = state["longest_round_seconds"]

    def on_fit_start(self, engine, loop) -> None:
        self._started = time.monotonic()

    def on_round_start(self, engine, loop, round_index: int) -> None:
        now = time.monotonic()
        if self._round_started:
            self._longest_round = max(self._longest_round, now - self._round_started)
        self._round_started = now
        # The request stops the run after this round: stop here if the next one would not fit.
        if now + 2 * self._longest_round - self._started > self.max_seconds:
            loop.request_stop(f"time budget of {self.max_seconds} s", final=False)


# The run's own callbacks, built by `fit` from its settings; user callbacks run between
# `Evaluate` and `SaveCheckpoint`, so that what they add to the metrics is saved and logged.

class Evaluate(Callback):
    """The global model on the test split (and the clients' held-out samples, with data.validation)
    every `every` rounds and after the last one."""

    def __init__(self, every: int):
        self.every = every

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        if metrics["round"] % self.every == 0 or metrics["round"] == loop.rounds:
            started = time.perf_counter()
            metrics.update(loop.evaluate())
            metrics["eval_seconds"] = time.perf_counter() - started


class SaveCheckpoint(Callback):
    """A checkpoint every `every` rounds, after the last one, and whenever the run stops."""

    def __init__(self, every: int):
        self.every = every

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        if loop.stopping or metrics["round"] % self.every == 0 or metrics["round"] == loop.rounds:
            loop.save_checkpoint()


class WriteMetrics(Callback):
    """metrics.jsonl (rank 0): the checkpoint's rows first, then one row per round."""

    def on_fit_start(self, engine, loop) -> None:
        self.log = MetricsLog(loop.out_dir, loop.history) if engine.global_rank == 0 else None

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        if self.log is not None:
            self.log.append(metrics)


class LogToWandb(Callback):
    """The W&B run (rank 0): started with the rounds it lacks replayed, closed at the end, also
    after a failure, and before a requeue (Slurm kills the job's steps as soon as it is requeued),
    with W&B's service under SLURM (WandbRun.finish)."""

    def __init__(self, run: WandbRun):
        self.run = run

    def on_fit_start(self, engine, loop) -> None:
        if engine.global_rank == 0:
            self.run.start(loop.hyperparameters)
            self.run.replay(loop.history)

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        if engine.global_rank == 0:
            self.run.log(metrics)

    def on_fit_end(self, engine, loop) -> None:
        if engine.global_rank == 0:
            self.run.finish(loop.history, folder_writable=not isinstance(loop.failure, WriteFailed))


class ShowProgress(Callback):
    """A progress bar, or one line per round when it is off or its output (stderr) is no terminal: a
    bar redraws itself with carriage returns, which a log file (a batch job's, `fit ... 2> log`) keeps
    as frames on one line; a summary at the end."""

    def __init__(self, progress_bar: bool):
        self.progress_bar = progress_bar
        self._bar = None

    def on_fit_start(self, engine, loop) -> None:
        if engine.global_rank == 0 and self.progress_bar and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=loop.rounds, initial=loop.start_round, desc="rounds", unit="round",
                             dynamic_ncols=True)

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        if engine.global_rank != 0:
            return
        if self._bar is None:
            print(round_line(metrics, loop.rounds), flush=True)
            return
        self._bar.update(1)
        accuracies = [row[TEST_ACCURACY] for row in loop.history if TEST_ACCURACY in row]
        self._bar.set_postfix(s_per_round=f"{metrics['round_seconds']:.2f}",
                              acc=f"{accuracies[-1]:.4f}" if accuracies else "-")

    def on_fit_end(self, engine, loop) -> None:
        if self._bar is not None:
            self._bar.close()
        if engine.global_rank == 0 and not loop.failed:
            print(summary_line(loop.history, loop.rounds, loop.out_dir, loop.stop_reasons, loop.final_stop),
                  flush=True)


class StopOnSignal(Callback):
    """Turns SIGTERM and the requeue signal, received at any time (also before the first round),
    into a stop agreed at the round's aggregation; after the checkpoint, rank 0 requeues a SLURM
    job that Slurm still reports RUNNING (fl_lightning.cluster.requeue_after_stop)."""

    def __init__(self, signal_name: Optional[str]):
        self.signal_name = signal_name
        self._installed: list = []

    def on_fit_start(self, engine, loop) -> None:
        self._installed = STOP_SIGNALS.install(self.signal_name)
        STOP_SIGNALS.listener = lambda signum: loop.request_stop(f"signal {signum.name}", requeue=True)
        for signum in sorted(STOP_SIGNALS.received):
            STOP_SIGNALS.listener(signum)

    def on_fit_end(self, engine, loop) -> None:
        STOP_SIGNALS.listener = None
        try:
            if engine.global_rank == 0 and loop.requeue_agreed and loop.stopped_early:
                requeue_after_stop(self.signal_name, STOP_SIGNALS.received)
        finally:
            STOP_SIGNALS.uninstall(self._installed)
