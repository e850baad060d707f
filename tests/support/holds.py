"""A callback that holds a run at a known round, so that a test signals or inspects it there
whatever the machine's speed, and what a test gives a run to be held. Runs started as processes
import this module with the tests' helpers on PYTHONPATH (`pythonpath`)."""

import os
import time
from pathlib import Path

from paths import SUPPORT

from fl_lightning.callbacks import Callback
from fl_lightning.cluster import STOP_SIGNALS

HOLD_S = 120


class HoldAfterRound(Callback):
    """At the start of round `after + 1`, while <out_dir>/hold exists: writes <out_dir>/held_rank<r>,
    then waits until this rank is asked to stop or the file is removed (at most HOLD_S seconds)."""

    def __init__(self, after: int):
        self.after = after

    def on_round_start(self, engine, loop, round_index: int) -> None:
        hold = Path(loop.out_dir) / "hold"
        if round_index != self.after or not hold.exists():
            return
        (Path(loop.out_dir) / f"held_rank{engine.global_rank}").touch()
        deadline = time.monotonic() + HOLD_S
        while hold.exists() and not STOP_SIGNALS.requested and time.monotonic() < deadline:
            time.sleep(0.01)


def hold_after(after: int) -> dict:
    """HoldAfterRound(after) as a `callbacks` entry of a config."""
    return {"class_path": "holds.HoldAfterRound", "init_args": {"after": after}}


def pythonpath() -> str:
    """PYTHONPATH for a run that imports this module: the tests' helpers first."""
    return os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))
