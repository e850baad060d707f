"""The fit command line of the fault and stop tests (rounds of a few milliseconds, checkpoints far enough apart
for a kill between two), the environment of its processes, a run held at a known round, and the wait for
several processes."""

import json
import os
import sys
from pathlib import Path

import holds
import processes
from paths import QUICKSTART

FIT = [sys.executable, "-m", "fl_lightning", "fit"]


ROUNDS = 30


CHECKPOINT_EVERY = 10


TRAINING = [
    "--config", str(QUICKSTART), "--model.options", "{hidden: 32, depth: 1}", "--logger.progress_bar", "false",
    "--federation.rounds", str(ROUNDS), "--federation.clients_per_round", "3", "--federation.local_steps", "2",
    "--federation.eval_every", str(ROUNDS), "--checkpoint.every", str(CHECKPOINT_EVERY), "--checkpoint.keep", "3",
    "--resume", "auto",
]


RUN_TIMEOUT_S = 180


SLURM_JOB_ID = "4242"


def fit_command(out_dir: Path, *extra: str) -> list[str]:
    return [*FIT, *TRAINING, "--out_dir", str(out_dir), *extra]


def process_environment(**extra: str) -> dict[str, str]:
    # One thread per process: the machine may have as few cores as the ranks.
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "OMP_NUM_THREADS": "1", **extra}


def wait_all(running: list[processes.Popen]) -> list[int]:
    try:
        return [p.wait(timeout=RUN_TIMEOUT_S) for p in running]
    finally:
        for p in running:
            if p.poll() is None:
                p.kill()
                p.wait()


# The runs that a stop signal interrupts (two ranks here, one in tests/integration/test_stops.py): held at the start of
# round HELD_ROUND + 1 (tests/support/holds.py) until they are signalled or their folder's `hold` file is
# gone, so the signal lands at a known round whatever the machine's speed.
HELD_RUN_ROUNDS = 6


HELD_ROUND = 2


def held_run_arguments() -> list[str]:
    """`fit` options of a run of HELD_RUN_ROUNDS rounds, one evaluation and checkpoint at the end, held
    after HELD_ROUND while its folder has a file `hold` (its process needs `holds.pythonpath()`)."""
    return ["--federation.rounds", str(HELD_RUN_ROUNDS), "--federation.eval_every", str(HELD_RUN_ROUNDS),
            "--checkpoint.every", str(10 * HELD_RUN_ROUNDS), "--callbacks", json.dumps([holds.hold_after(HELD_ROUND)])]
