"""Callbacks a test names by class path in a config, as a user would name their own."""

import errno
from pathlib import Path
from typing import Optional

import torch

from fl_lightning.callbacks import Callback


class RecordHooks(Callback):
    """Appends each hook it sees to <folder>/hooks_rank<r>.txt."""

    def __init__(self, folder: str):
        self.folder = folder

    def _record(self, engine, line: str) -> None:
        with open(Path(self.folder) / f"hooks_rank{engine.global_rank}.txt", "a") as f:
            f.write(line + "\n")

    def on_fit_start(self, engine, loop) -> None:
        self._record(engine, f"fit_start {loop.start_round}")

    def on_round_start(self, engine, loop, round_index: int) -> None:
        self._record(engine, f"round_start {round_index + 1}")

    def on_client_end(self, engine, loop, client, uploads: dict, weight: float) -> None:
        self._record(engine, f"client_end {client.round + 1} {client.client_id} {sorted(uploads)} {weight:.4f}")

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        self._record(engine, f"round_end {metrics['round']} {'test_accuracy' in metrics}")

    def on_fit_end(self, engine, loop) -> None:
        self._record(engine, f"fit_end {loop.completed_rounds}")


class StopAfterRound(Callback):
    """Asks to stop once `round` has ended (`final` as `loop.request_stop` takes it: unset, a user
    callback's stop is final); the request is agreed at the next aggregation."""

    def __init__(self, round: int, final: Optional[bool] = None):
        self.round, self.final = round, final

    def on_round_end(self, engine, loop, metrics: dict) -> None:
        if metrics["round"] == self.round:
            loop.request_stop(f"asked to stop after round {self.round}", final=self.final)


class InterruptEveryRound(Callback):
    """Interrupts the run after each round it starts: run again and again, the same command trains
    one round at a time."""

    def on_round_start(self, engine, loop, round_index: int) -> None:
        loop.request_stop(f"interrupted in round {round_index + 1}", final=False)


class RequeueInRound(Callback):
    """Asks for a requeue in round `round`, as a preemption signal does, and writes whether the ranks
    agreed to requeue to <out_dir>/requeue_agreed.txt at the end."""

    def __init__(self, round: int):
        self.round = round

    def on_round_start(self, engine, loop, round_index: int) -> None:
        if round_index + 1 == self.round:
            loop.request_stop("preempted", requeue=True)

    def on_fit_end(self, engine, loop) -> None:
        (Path(loop.out_dir) / "requeue_agreed.txt").write_text(str(loop.requeue_agreed))


class RecordThreads(Callback):
    """Appends `<world size> <torch threads>` at each round's start to <folder>/threads_rank<r>.txt."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_round_start(self, engine, loop, round_index: int) -> None:
        with open(Path(self.folder) / f"threads_rank{engine.global_rank}.txt", "a") as f:
            f.write(f"{engine.world_size} {torch.get_num_threads()}\n")


class FillTheDisk(Callback):
    """At the start of round `round`, while <out_dir>/../fill exists: fills the file system of out_dir
    (a file `filler` beside out_dir) and removes `fill`, so that the same command run again does not."""

    def __init__(self, round: int):
        self.round = round

    def on_round_start(self, engine, loop, round_index: int) -> None:
        trigger = Path(loop.out_dir).parent / "fill"
        if round_index + 1 != self.round or not trigger.exists():
            return
        trigger.unlink()
        with open(trigger.parent / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(bytes(4096))
            except OSError as err:
                assert err.errno == errno.ENOSPC
