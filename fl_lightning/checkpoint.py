"""Checkpoints: written atomically, verified on load, the newest good one found for resume.

Layout: out_dir/checkpoints/round_000010.ckpt ... and last.ckpt (a hard link to the newest).
A checkpoint is a plain dict saved with `torch.save`, loadable with `torch.load`. Per-client state
of stateful algorithms is saved by each owner rank beside it, as round_000010.clients_rank0.pt ...,
before the main file (whose presence marks the checkpoint complete).
"""

from __future__ import annotations

import os
import sys
import re
import warnings
from pathlib import Path
from typing import Optional, Union

import torch

from fl_lightning.config import ConfigError

LAST = "last.ckpt"
_NUMBERED = re.compile(r"round_(\d+)\.ckpt$")
REQUIRED_KEYS = ("round", "model", "algorithm", "partition")


def checkpoint_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def _atomic_replace(write, target: Path) -> None:
    """Write through `write(tmp_path)` then rename over `target`: readers see the old file or the
    complete new one, never a partial write."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _save_file(obj, target: Path) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())

    _atomic_replace(write, target)


def client_shard_path(folder: Path, round_completed: int, rank: int) -> Path:
    return folder / f"round_{round_completed:06d}.clients_rank{rank}.pt"


def save_client_shard(states: dict, out_dir: Path, round_completed: int, rank: int) -> None:
    folder = checkpoint_dir(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    _save_file(states, client_shard_path(folder, round_completed, rank))


def load_client_shards(checkpoint_path: Path, round_completed: int, num_shards: int) -> dict:
    """Every rank's saved client states for that checkpoint, merged: client id -> state."""
    merged: dict = {}
    for rank in range(num_shards):
        path = client_shard_path(Path(checkpoint_path).parent, round_completed, rank)
        try:
            # mmap: a rank copies out only the clients it owns, not every client's state.
            merged.update(torch.load(path, map_location="cpu", weights_only=False, mmap=True))
        except Exception as err:
            raise ValueError(f"client-state shard {path} is missing or unreadable ({err})") from err
    return merged


def save_checkpoint(state: dict, out_dir: Path, keep: int) -> Path:
    folder = checkpoint_dir(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    numbered = folder / f"round_{state['round']:06d}.ckpt"
    _save_file(state, numbered)
    _atomic_replace(lambda tmp: os.link(numbered, tmp), folder / LAST)
    for stale in numbered_checkpoints(folder)[:-keep]:
        for path in folder.glob(stale.name.removesuffix(".ckpt") + ".*"):
            path.unlink(missing_ok=True)
    return numbered


def numbered_checkpoints(folder: Path) -> list[Path]:
    """Numbered checkpoints in `folder`, oldest first."""
    found = [(int(m.group(1)), p) for p in folder.glob("round_*.ckpt") if (m := _NUMBERED.search(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path) -> dict:
    """Load and verify one checkpoint; raises ValueError naming the file when it is unusable."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated or corrupt file fails in many ways inside torch.load
        raise ValueError(f"checkpoint {path} is unreadable ({type(err).__name__}: {err})") from err
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing}")
    state["client_states"] = load_client_shards(path, state["round"], state.get("client_state_shards", 0))
    return state


def resolve_resume(resume: Union[None, str, Path], out_dir: Path) -> Optional[dict]:
    """The state to resume from: None starts fresh; "auto" takes the newest good checkpoint in
    out_dir (skipping corrupt ones with a warning), or none; a path must exist and load."""
    if resume is None:
        return None
    if str(resume) != "auto":
        path = Path(resume)
        if not path.is_file():
            raise ConfigError("resume", "an existing checkpoint file, 'auto' or null", str(resume))
        return load_checkpoint(path)
    candidates = numbered_checkpoints(checkpoint_dir(out_dir))[::-1]
    for path in candidates:
        try:
            state = load_checkpoint(path)
            print(f"resuming from {path} (round {state['round']})", file=sys.stderr, flush=True)
            return state
        except ValueError as err:
            warnings.warn(f"{err}; trying the previous checkpoint", stacklevel=2)
    if candidates:
        raise ValueError(f"no usable checkpoint in {checkpoint_dir(out_dir)}: every one failed to load")
    return None
