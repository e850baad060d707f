"""A run folder's life as `fit` leads it: checked writable, taken (its lock, what a killed attempt left
cleared), judged (a fresh run, or the checkpoint to continue once it is certain to belong to the same
experiment) and, for a run that had already ended, its logs completed without training. What a folder
holds and how it is named is run_dir.py; its checkpoints, checkpoint.py."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, Optional, Union

from fl_lightning.checkpoint import (
    FINAL_STOP,
    load_resume_file,
    newest_good_checkpoint,
    remove_orphan_shards,
    remove_temporary_files,
    restore_last,
)
from fl_lightning.config import LoggerArgs
from fl_lightning.errors import ConfigError
from fl_lightning.run_dir import (
    CONFIG_FILE,
    RunDirLock,
    check_same_experiment,
    holds_results,
    recorded_config,
    remove_results,
    report_safe_changes,
)
from fl_lightning.run_logging import MetricsLog, WandbIdentity, new_wandb_run


def check_writable(out_dir: Path) -> None:
    """Refuse, before anything else, a run folder that cannot be created or written."""
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        probe = Path(out_dir) / f".write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError("out_dir", "a folder that can be created and written", f"{out_dir} ({err.strerror})") from err


@contextlib.contextmanager
def taken(out_dir: Path, launching: bool) -> Iterator[None]:
    """The run folder held by this run while it trains (its lock, which `sweep` and a second `fit` see): the
    launching process takes it and clears what a killed attempt left (temporary files, orphan shards)."""
    lock = RunDirLock(out_dir)
    try:
        if launching:
            lock.acquire()
            print(f"run folder: {out_dir}", flush=True)
            remove_temporary_files(out_dir)
            remove_orphan_shards(out_dir)
        yield
    finally:
        lock.release()


def resume_state(out_dir: Path, config: dict, rounds: int, resume: Optional[Union[Literal["auto"], Path]],
                 overwrite: bool, launching: bool) -> Optional[dict]:
    """The checkpoint to continue from (None: a fresh run, the folder's results removed with `overwrite`),
    once it is certain to belong to the experiment of `config`; `launching`: this process is the one that
    judges and changes the folder."""
    if resume is None or overwrite:
        # Only the launching process judges the folder: other ranks may start after it wrote there.
        if launching and holds_results(out_dir):
            if not overwrite:
                raise ConfigError("resume", f"'auto' to continue the run already in {out_dir}, overwrite: true to "
                                  "replace it, or another out_dir", None)
            remove_results(out_dir)
        return None
    state = newest_good_checkpoint(out_dir) if str(resume) == "auto" else load_resume_file(Path(resume))
    records = [(recorded_config(out_dir), f"{out_dir / CONFIG_FILE}")]
    if state is not None:
        records.insert(0, (state["hyperparameters"], f"the checkpoint of round {state['round']}"))
    if state is not None and state["round"] > rounds:
        raise ConfigError("federation.rounds", f"at least {state['round']}, the round the checkpoint in {out_dir} "
                          "reached (more rounds continue the run)", rounds)
    # The checkpoint and the folder's config.yaml (which differ when --resume names a checkpoint
    # elsewhere) must both be this experiment's; the checkpoint's safe changes are the ones reported.
    compared = [(recorded, source) for recorded, source in records if recorded is not None]
    for index, (recorded, source) in enumerate(compared):
        changes = check_same_experiment(recorded, config, source, out_dir)
        if launching and index == 0:
            report_safe_changes(changes)
    if launching and state is not None and str(resume) == "auto":
        restore_last(out_dir, state)
    return state


def complete_logs_of_finished_run(logger: LoggerArgs, out_dir: Path, identity: WandbIdentity, config: dict,
                                  state: dict, rounds: int) -> None:
    """A finished run asked to run again (a requeued job that had ended, a sweep run again) trains
    nothing, but makes sure its logs hold every round: it may have been killed between its last
    checkpoint and logs. So does a run stopped for good (early stopping), whatever `rounds` is now."""
    if state.get(FINAL_STOP) is None:
        print(f"{out_dir} holds a finished run (round {state['round']}); nothing to train", file=sys.stderr, flush=True)
    else:
        print(f"{out_dir} holds a run stopped for good at round {state['round']} ({state[FINAL_STOP]}); nothing to "
              f"train, also with federation.rounds {rounds}: a final stop is not continued (a new run, in another "
              "out_dir, trains past it)", file=sys.stderr, flush=True)
    MetricsLog(out_dir, state["metrics"])
    wandb = new_wandb_run(logger, out_dir, identity)
    if wandb is not None:
        wandb.start(config)
        wandb.replay(state["metrics"])
        wandb.finish(state["metrics"])
