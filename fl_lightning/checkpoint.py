"""Checkpoints: written atomically, checksummed, verified on load, the newest good one found for resume.

Layout: out_dir/checkpoints/round_000010.ckpt ... and last.ckpt (a hard link to the newest), the file
users and evaluation scripts load: a resume checks it too, and puts the newest good checkpoint in its
place when it is damaged, missing or behind (`restore_last`). A checkpoint is a plain dict saved with
`torch.save`, loadable with `torch.load`. Per-client state of stateful algorithms lives in the
client-state store's files, out_dir/client_states/<id // 1000>/client_0001234.r000010.safetensors (client
1234's state after round 10; `fl_lightning.federation.client_store` writes them). Which file holds each
client's state as of a checkpoint is an index made of deltas: before the main file (whose presence marks
the checkpoint complete), each owner rank writes out_dir/client_states/index/round_000010.rank0.pt ...,
the clients whose file changed since the previous checkpoint; the main file lists its deltas and every
earlier one's (`CLIENT_INDEX`), which pruning keeps, so that no checkpoint writes every client's entry.
Checkpoints of earlier versions kept shards beside them instead (round_000010.clients_rank0.pt: every
client's version, or its state itself), and still resume; pruning removes such a checkpoint's shards
before its main file, and `remove_orphan_shards` clears those a kill left.

Each file carries a SHA-256 digest of its content (tensors by their bytes), checked on load: a
flipped byte in a tensor would otherwise load without complaint and silently change the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Optional

import numpy as np
import safetensors.torch
import torch

from fl_lightning import atomic_files
from fl_lightning.errors import ConfigError, RunWarning

LAST = "last.ckpt"
DIGEST = "sha256"
_NUMBERED = re.compile(r"round_(\d+)\.ckpt$")
_SHARD = re.compile(r"round_(\d+)\.clients_rank\d+\.pt$")
_INDEX = re.compile(r"^round_(\d+)\.rank\d+\.pt$")
REQUIRED_KEYS = ("round", "model", "algorithm", "metrics", "hyperparameters", DIGEST)
# The clients' samples, by their digests (`fl_lightning.data.ClientSamples.digest`; the validation one None
# without a validation split); checkpoints of earlier versions hold every client's indices as lists instead.
PARTITION_DIGEST, VALIDATION_DIGEST = "partition_sha256", "validation_sha256"
EARLIER_PARTITION, EARLIER_VALIDATION = "partition", "validation"
# Optional keys (absent from checkpoints of earlier versions, which resume as if they were empty):
FINAL_STOP = "final_stop"  # the reason of a final stop, or None: the run is over
PENDING_FINAL_STOPS = "pending_final_stops"  # final stops asked for after the round's aggregation
CALLBACKS = "callbacks"  # the callbacks' state, by `callback_key`


def checkpoint_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def content_digest(value) -> str:
    """SHA-256 over a nested structure of dicts, lists, tensors, arrays and scalars, independent of
    how torch serialises it, so that it can be checked after loading."""
    digest = hashlib.sha256()
    _update_digest(digest, value)
    return digest.hexdigest()


def _update_digest(digest, value) -> None:
    if isinstance(value, dict):
        digest.update(b"{")
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _update_digest(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for item in value:
            _update_digest(digest, item)
        digest.update(b"]")
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"tensor{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(f"array{value.dtype}{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    else:
        digest.update(repr(value).encode())


def remove_temporary_files(out_dir: Path) -> None:
    """Temp files left by a process killed mid-write. Called while holding the out_dir lock, so no
    live writer owns them."""
    for tmp in checkpoint_dir(out_dir).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def remove_orphan_shards(out_dir: Path) -> None:
    """Client-state shards whose main checkpoint is missing (a kill while pruning it) and that are
    older than the newest numbered checkpoint. Newer ones are left: a checkpoint's shards are written
    before its main file, so they may belong to one still being written (or to the round a killed
    save reached, which the next save of that round overwrites)."""
    folder = checkpoint_dir(out_dir)
    complete = {int(_NUMBERED.search(path.name).group(1)) for path in numbered_checkpoints(folder)}
    for shard in folder.glob("round_*.clients_rank*.pt"):
        match = _SHARD.search(shard.name)
        if match and int(match.group(1)) not in complete and int(match.group(1)) < max(complete, default=0):
            shard.unlink(missing_ok=True)


def _save_file(obj: dict, target: Path, synced: bool = True) -> None:
    obj = {**obj, DIGEST: content_digest(obj)}
    atomic_files.write_atomically(target, lambda file: torch.save(obj, file), synced)


def _load_verified(path: Path, what: str = "checkpoint", **load_options) -> dict:
    """Load a file written by `_save_file`; ValueError naming it (as `what`) when unreadable or altered."""
    if not path.is_file():
        raise ValueError(f"{what} {path} is missing")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, **load_options)
    except Exception as err:  # a truncated or corrupt file fails in many ways inside torch.load
        raise ValueError(f"{what} {path} is unreadable ({type(err).__name__}: {err})") from err
    if not isinstance(state, dict) or DIGEST not in state:
        raise ValueError(f"{what} {path} has no {DIGEST} digest: not written by this version")
    expected = state.pop(DIGEST)
    if content_digest(state) != expected:
        raise ValueError(f"{what} {path} fails its {DIGEST} check: its content was altered after saving")
    return state


def client_shard_path(folder: Path, round_completed: int, rank: int) -> Path:
    """A client-state shard of a checkpoint of an earlier version (which file, or the states themselves)."""
    return folder / f"round_{round_completed:06d}.clients_rank{rank}.pt"


CLIENT_STATES = "client_states"
CLIENT_INDEX = "client_state_index"
"""A checkpoint's key: the checkpoints, oldest first, whose index deltas make its client-state index."""
NOT_SAVED = -1
"""The version of a client with no saved state (it never trained)."""
_STATE_SUFFIX, _EARLIER_STATE_SUFFIX = ".safetensors", ".pt"


def client_state_path(out_dir: Path, client_id: int, version: int) -> Path:
    """The file of client `client_id`'s state after round `version` (a thousand clients a folder)."""
    return Path(client_state_paths(out_dir, client_id, version)[0])


def client_state_paths(out_dir: Path, client_id: int, version: int) -> tuple[str, str]:
    """That file, and its name in runs of earlier versions (a torch.save file): strings, not pathlib
    objects (`atomic_files.replace_atomically` says why), as the store names them every round."""
    name = os.path.join(out_dir, CLIENT_STATES, f"{client_id // 1000:04d}", f"client_{client_id:07d}.r{version:06d}")
    return name + _STATE_SUFFIX, name + _EARLIER_STATE_SUFFIX


def save_client_state(out_dir: Path, client_id: int, version: int, state: dict) -> None:
    """A safetensors file (raw tensors after a small header: written and read several times faster than
    a torch.save file, as a store past its bound does for every client of a round) whose metadata holds
    the client, the version and the digest. Written atomically but not synced: the store syncs the
    files a checkpoint refers to (`os.sync`, once) before the checkpoint."""
    path = client_state_paths(out_dir, client_id, version)[0]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    identity = {"client": str(client_id), "version": str(version)}
    payload = safetensors.torch.save(state, metadata={**identity, DIGEST: content_digest([identity, state])})
    atomic_files.write_atomically(path, lambda file: file.write(payload), synced=False)


def load_client_state(out_dir: Path, client_id: int, version: int) -> dict:
    """Client `client_id`'s state after round `version`; ValueError naming the client and the file
    when it is missing, unreadable, altered or another client's."""
    path, earlier = client_state_paths(out_dir, client_id, version)
    what = f"the state of client {client_id},"
    if not os.path.isfile(path) and os.path.isfile(earlier):
        saved = _load_verified(Path(earlier), what)
        identity, state = (saved["client"], saved["version"]), saved["state"]
    else:
        identity, state = _load_safetensors(path, what)
    if identity != (client_id, version):
        raise ValueError(f"{what} {path}, holds client {identity[0]} after round {identity[1]}")
    return state


def _load_safetensors(path: str, what: str) -> tuple[tuple[int, int], dict]:
    """The (client, version) and the state of a file written by `save_client_state`, its digest checked."""
    try:
        with open(path, "rb") as file:  # not a pathlib object: see client_state_paths
            payload = file.read()
    except FileNotFoundError:
        raise ValueError(f"{what} {path} is missing") from None
    try:
        state = safetensors.torch.load(payload)
        # The format: an 8-byte little-endian header length, then the JSON header.
        metadata = json.loads(payload[8:8 + int.from_bytes(payload[:8], "little")])["__metadata__"]
        identity = {"client": metadata["client"], "version": metadata["version"]}
        expected = metadata[DIGEST]
    except Exception as err:  # a truncated or corrupt file fails in many ways
        raise ValueError(f"{what} {path} is unreadable ({type(err).__name__}: {err})") from err
    if content_digest([identity, state]) != expected:
        raise ValueError(f"{what} {path} fails its {DIGEST} check: its content was altered after saving")
    return (int(identity["client"]), int(identity["version"])), state


class ClientStateFiles(Mapping):
    """A checkpoint's client states as the store's files: client id -> state, each read (and checked)
    only when asked for; `versions[c]` is the round after which client c's state was saved
    (NOT_SAVED: never trained)."""

    def __init__(self, out_dir: Path, versions: np.ndarray):
        self.out_dir, self.versions = Path(out_dir), versions

    def __getitem__(self, client_id: int) -> dict:
        if not 0 <= client_id < len(self.versions) or self.versions[client_id] == NOT_SAVED:
            raise KeyError(client_id)
        return load_client_state(self.out_dir, client_id, int(self.versions[client_id]))

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self.versions != NOT_SAVED).tolist())

    def __len__(self) -> int:
        return int(np.count_nonzero(self.versions != NOT_SAVED))

    def verify(self) -> None:
        """Read every file the checkpoint refers to, one at a time: ValueError naming the first client
        whose file is missing or damaged."""
        for client_id in self:
            self[client_id]


def client_index_path(out_dir: Path, round_completed: int, rank: int) -> Path:
    return Path(out_dir) / CLIENT_STATES / "index" / f"round_{round_completed:06d}.rank{rank}.pt"


def save_client_index(out_dir: Path, round_completed: int, rank: int, clients: np.ndarray,
                      versions: np.ndarray) -> None:
    """A rank's index delta of a checkpoint: the clients whose saved state changed since the previous
    checkpoint, and the version of each; the checkpoint lists the deltas that make its whole index
    (`CLIENT_INDEX`), so that what it writes does not grow with the clients of the federation."""
    path = client_index_path(out_dir, round_completed, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save_file({"round": round_completed, "clients": clients, "versions": versions}, path)


def load_client_index(out_dir: Path, deltas: list) -> np.ndarray:
    """The version of every client's state (NOT_SAVED: none) after the index `deltas` ((round, ranks)
    pairs, oldest first); ValueError naming a delta that is missing or damaged."""
    versions = np.full(0, NOT_SAVED, dtype=np.int32)
    for round_completed, ranks in deltas:
        for rank in range(ranks):
            path = client_index_path(out_dir, round_completed, rank)
            delta = _load_verified(path, "client-state index")
            if len(delta["clients"]):
                versions = extended_versions(versions, int(delta["clients"].max()) + 1)
            versions[delta["clients"]] = delta["versions"]
    return versions


def remove_later_client_indexes(out_dir: Path, round_completed: int) -> None:
    """Index deltas of checkpoints after `round_completed` (a run killed after writing them, or a
    checkpoint a resume skipped), and temporary files: no resume from `round_completed` refers to them."""
    for path in Path(out_dir, CLIENT_STATES, "index").glob("*round_*"):
        match = _INDEX.match(path.name)
        if match is None or int(match.group(1)) > round_completed:
            path.unlink(missing_ok=True)


def extended_versions(versions: np.ndarray, size: int) -> np.ndarray:
    """`versions` grown to `size` clients, the new ones NOT_SAVED."""
    if size <= len(versions):
        return versions
    longer = np.full(size, NOT_SAVED, dtype=np.int32)
    longer[:len(versions)] = versions
    return longer


def load_client_states(checkpoint_path: Path, state: dict) -> Mapping:
    """A checkpoint's client states: client id -> state (the store's files, `ClientStateFiles`, each
    checked here; or, in a checkpoint of an earliest version, the states themselves)."""
    out_dir = Path(checkpoint_path).parent.parent
    if CLIENT_INDEX in state:
        versions = load_client_index(out_dir, state[CLIENT_INDEX])
    else:
        earlier = _earlier_client_shards(checkpoint_path, state["round"], state.get("client_state_shards", 0))
        if not isinstance(earlier, np.ndarray):
            return earlier
        versions = earlier
    files = ClientStateFiles(out_dir, versions)
    try:
        files.verify()
    except ValueError as err:
        raise ValueError(f"checkpoint {checkpoint_path}: {err}") from err
    return files


def _earlier_client_shards(checkpoint_path: Path, round_completed: int, num_shards: int):
    """The client states of a checkpoint of an earlier version, from its shards: every client's
    version (an array), or the states themselves (a dict)."""
    merged: dict = {}
    versions = np.full(0, NOT_SAVED, dtype=np.int32)
    for rank in range(num_shards):
        path = client_shard_path(Path(checkpoint_path).parent, round_completed, rank)
        if not path.is_file():
            raise ValueError(f"client-state shard {path} of checkpoint {checkpoint_path} is missing")
        # mmap: a rank copies out only the clients it owns, not every client's state.
        shard = _load_verified(path, mmap=True)
        if "clients" in shard:
            merged.update(shard["clients"])
        else:
            saved = shard["client_versions"]
            versions = extended_versions(versions, len(saved))
            versions[:len(saved)] = np.maximum(versions[:len(saved)], saved)
    return merged if merged else versions


def save_checkpoint(state: dict, out_dir: Path, keep: int) -> Path:
    folder = checkpoint_dir(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    numbered = numbered_checkpoint(folder, state["round"])
    _save_file(state, numbered)
    _link_last(numbered)
    for stale in numbered_checkpoints(folder)[:-keep]:
        # Shards first: the main file is what marks a checkpoint complete, so it goes last.
        for shard in folder.glob(stale.name.removesuffix(".ckpt") + ".clients_rank*.pt"):
            shard.unlink(missing_ok=True)
        stale.unlink(missing_ok=True)
    return numbered


def numbered_checkpoint(folder: Path, round_completed: int) -> Path:
    return folder / f"round_{round_completed:06d}.ckpt"


def _link_last(numbered: Path) -> None:
    atomic_files.replace_atomically(lambda temporary: os.link(numbered, temporary), numbered.parent / LAST)


def restore_last(out_dir: Path, state: dict) -> None:
    """Make last.ckpt the checkpoint a resume chose (`state`, the newest good one), with a warning,
    when it is unreadable, fails its checks, is missing or holds an earlier round: a finished run
    trains nothing, so nothing else would ever rewrite it."""
    folder = checkpoint_dir(out_dir)
    newest, last = numbered_checkpoint(folder, state["round"]), folder / LAST
    if not newest.is_file() or (last.is_file() and os.path.samefile(newest, last)):
        return  # the resume read last.ckpt itself, or last.ckpt is the newest checkpoint
    problem = _last_checkpoint_problem(last, state["round"])
    if problem is not None:
        warnings.warn(f"{problem}; rewritten from {newest} (round {state['round']})", RunWarning, stacklevel=2)
        _link_last(newest)


def _last_checkpoint_problem(last: Path, newest_round: int) -> Optional[str]:
    """What is wrong with last.ckpt beside a newest good checkpoint of `newest_round`; None when it
    passes its checks and holds that round or a later one (a copy, whose hard link a copy broke)."""
    if not last.is_file():
        return f"checkpoint {last} is missing"
    try:
        last_round = load_checkpoint(last)["round"]
    except ValueError as err:
        return str(err)
    if last_round < newest_round:
        return f"checkpoint {last} holds round {last_round}, behind the newest good checkpoint"
    return None


def last_good_checkpoint(out_dir: Path) -> Optional[Path]:
    """The checkpoint a rerun resumes from, as far as a failing run can tell without reading it: the
    newest numbered one (each is written whole, and after its shards)."""
    saved = numbered_checkpoints(checkpoint_dir(out_dir))
    return saved[-1] if saved else None


def rerun_advice(out_dir: Path, remedy: str = "") -> str:
    """What a run that cannot go on tells the user: its last good checkpoint, and that the same
    command (after `remedy`, if any) resumes from it."""
    last = last_good_checkpoint(out_dir)
    then = f"{remedy}, then " if remedy else ""
    if last is None:
        return f"no checkpoint was saved yet: {then}run the same command again to start the run"
    round_completed = int(_NUMBERED.search(last.name).group(1))
    return f"the last good checkpoint is {last}: {then}run the same command again to resume from round " \
           f"{round_completed}"


def run_is_over(state: dict, rounds: int) -> bool:
    """Whether the run a checkpoint belongs to has nothing left to train for `rounds` rounds: it
    reached them, or it recorded a final stop (`final_stop`, e.g. early stopping), which more rounds
    do not undo."""
    return state["round"] >= rounds or state.get(FINAL_STOP) is not None


def checkpoint_rounds(out_dir: Path) -> list[int]:
    """The rounds of the numbered checkpoints in out_dir, oldest first."""
    return [int(_NUMBERED.search(path.name).group(1)) for path in numbered_checkpoints(checkpoint_dir(out_dir))]


def numbered_checkpoints(folder: Path) -> list[Path]:
    """Numbered checkpoints in `folder`, oldest first."""
    found = [(int(m.group(1)), p) for p in folder.glob("round_*.ckpt") if (m := _NUMBERED.search(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path) -> dict:
    """Load and verify one checkpoint and its client-state shards; raises ValueError naming the
    file when it is unusable."""
    state = _load_verified(path)
    missing = [k for k in REQUIRED_KEYS if k != DIGEST and k not in state]
    if PARTITION_DIGEST not in state and EARLIER_PARTITION not in state:
        missing.append(PARTITION_DIGEST)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing}")
    state["client_states"] = load_client_states(path, state)
    return state


def resume_candidates(out_dir: Path) -> list[Path]:
    """Checkpoints in out_dir to try, best first: numbered ones newest first, then last.ckpt (the
    only one left when the numbered files were deleted)."""
    folder = checkpoint_dir(out_dir)
    candidates = numbered_checkpoints(folder)[::-1]
    if (folder / LAST).is_file():
        candidates.append(folder / LAST)
    return candidates


def newest_good_checkpoint(out_dir: Path) -> Optional[dict]:
    """The newest checkpoint in out_dir that loads and passes its checks (skipping bad ones with a
    warning); None when there is none at all; ValueError when every one is bad."""
    candidates = resume_candidates(out_dir)
    for path in candidates:
        try:
            state = load_checkpoint(path)
        except ValueError as err:
            warnings.warn(f"{err}; trying the previous checkpoint", RunWarning, stacklevel=2)
            continue
        print(f"resuming from {path} (round {state['round']})", file=sys.stderr, flush=True)
        return state
    if candidates:
        raise ConfigError("resume", f"a usable checkpoint in {checkpoint_dir(out_dir)} (every one failed its "
                          "checks; see the warnings above) or a new out_dir", "auto")
    return None


def load_resume_file(path: Path) -> dict:
    """An explicitly named checkpoint: it must exist and pass every check."""
    if not Path(path).is_file():
        raise ConfigError("resume", "an existing checkpoint file, 'auto' or null", str(path))
    try:
        return load_checkpoint(Path(path))
    except ValueError as err:
        raise ConfigError("resume", "a checkpoint written by fl-lightning that passes its checks", str(err)) from err
