"""The per-client state of stateful algorithms (SCAFFOLD's c_i, FedDyn's h_i, MOON's previous model),
kept by each client's owner rank in bounded memory (`compute.client_state_memory_mib`).

States are kept in host memory while they fit the bound, so a small run never touches the disk
between checkpoints. Past the bound, the least recently trained clients' states go to the run
folder's client-state files, one file per client and version: client_states/0001/
client_0001234.r000010.pt holds client 1234's state after round 10 (`fl_lightning.checkpoint`). Files
per client rather than memory-mapped arrays per rank: each is written whole, atomically (a
temporary file renamed over it) and with its own digest, so a kill mid-write loses nothing and a
damaged file is refused naming its client; a new version is a new file, so the older one a
checkpoint refers to stays as it was (memory-mapped arrays are written in place: a kill mid-write
would tear the state a checkpoint promised, and keeping versions would mean copying the array);
and the ranks' files never overlap, whatever the number of ranks a resume runs on.

A file is renamed into place whole but not flushed to disk on its own: a checkpoint syncs every file
written since the previous one (`os.sync`, once) before its shard and main file, so that a crash of
the machine loses nothing a checkpoint refers to, while a round that writes thousands of states past
the bound costs no disk flush each (a killed process leaves the page cache, and so each file, whole).

A checkpoint writes the states changed since the previous one (`checkpoint`) and refers to every
client's file by its version (one int per client, `fl_lightning.checkpoint.save_client_shard`),
so what it writes grows with the clients that trained, not with the clients of the federation.
A file that a newer version replaces is removed once no kept checkpoint can refer to it (`pruned`).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fl_lightning.checkpoint import (
    CLIENT_STATES,
    NOT_SAVED,
    client_state_path,
    load_client_state,
    save_client_state,
)

_CLIENT_FILE = re.compile(r"^\.?client_(\d+)\.r(\d+)\.pt(\.\d+\.tmp)?$")


class ClientStates:
    """One rank's clients' states: the newest `put` of each client, `get` wherever it lives.

    `by_client` holds the states in memory, least recently trained first. Without `out_dir` every
    state stays in memory; with it, states past `memory_bytes` are written to the client-state files
    and dropped from memory. States put are versioned by `round_completed` (set by the loop each round)."""

    def __init__(self, initial: Optional[dict] = None, out_dir: Optional[Path] = None,
                 memory_bytes: Optional[int] = None):
        self.by_client: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.out_dir, self.memory_bytes = out_dir, memory_bytes
        self.round_completed = 0
        self._pin = torch.cuda.is_available()
        self._bytes = 0
        self._version = np.full(0, NOT_SAVED, dtype=np.int32)  # of each client's newest state
        self._saved = np.full(0, NOT_SAVED, dtype=np.int32)  # of its newest file
        self._last_checkpoint = 0
        self._unsynced = False  # a file was written since the last sync
        self._superseded: list[tuple[int, int, int]] = []  # (client, version, replaced by version)
        for client_id, state in (initial or {}).items():
            self.put(client_id, state)

    @classmethod
    def resumed(cls, out_dir: Path, memory_bytes: Optional[int], round_completed: int, saved: Mapping,
                rank: int, world_size: int) -> "ClientStates":
        """Rank `rank`'s store (its clients: client id mod `world_size`) of a run resumed after
        `round_completed` (0: a new run) from a checkpoint's client states `saved`
        (`fl_lightning.checkpoint.ClientStateFiles`, or the states themselves in a checkpoint of an
        earlier version); its files the checkpoint does not refer to (written after it by a run
        killed later, or temporary files) are removed."""
        store = cls(out_dir=out_dir, memory_bytes=memory_bytes)
        store.round_completed = store._last_checkpoint = round_completed
        versions = getattr(saved, "versions", None)
        if versions is not None:
            owned = np.arange(len(versions)) % world_size == rank
            store._version = np.where(owned, versions, NOT_SAVED).astype(np.int32)
            store._saved = store._version.copy()
        store._sweep(lambda client_id: client_id % world_size == rank)
        if versions is None:
            for client_id, state in saved.items():
                if client_id % world_size == rank:
                    store.put(client_id, state)
        return store

    def get(self, client_id: int, device: torch.device) -> dict[str, torch.Tensor]:
        state = self.by_client.get(client_id)
        if state is None and self._version_of(self._saved, client_id) != NOT_SAVED:
            state = load_client_state(self.out_dir, client_id, int(self._saved[client_id]))
        return {k: v.to(device, non_blocking=True) for k, v in (state or {}).items()}

    def put(self, client_id: int, state: dict[str, torch.Tensor]) -> None:
        stored = {}
        for name, value in state.items():
            host = value.detach().to("cpu", copy=True)
            stored[name] = host.pin_memory() if self._pin else host
        self._drop(client_id)
        self.by_client[client_id] = stored
        self._bytes += _size(stored)
        self._grow(client_id)
        self._version[client_id] = self.round_completed
        while self._over_bound() and len(self.by_client) > 1:
            self._evict(next(iter(self.by_client)))

    def checkpoint(self, round_completed: int) -> np.ndarray:
        """Write the states changed since the last checkpoint, and sync every file written since (one
        `os.sync` rather than a flush a file); which file holds each client's state."""
        for client_id in self.by_client:
            self._write(client_id)
        if self._unsynced:
            os.sync()
            self._unsynced = False
        self._last_checkpoint = round_completed
        saved = np.flatnonzero(self._saved != NOT_SAVED)
        return self._saved[:saved[-1] + 1 if len(saved) else 0].copy()

    def pruned(self, kept_rounds: list[int]) -> None:
        """Remove the files replaced by a version that every kept checkpoint (`kept_rounds`) refers to."""
        oldest = min(kept_rounds, default=self._last_checkpoint)
        still_needed = []
        for client_id, version, replaced_by in self._superseded:
            if replaced_by <= oldest:
                client_state_path(self.out_dir, client_id, version).unlink(missing_ok=True)
            else:
                still_needed.append((client_id, version, replaced_by))
        self._superseded = still_needed

    def _over_bound(self) -> bool:
        return self.out_dir is not None and self.memory_bytes is not None and self._bytes > self.memory_bytes

    def _evict(self, client_id: int) -> None:
        self._write(client_id)
        self._drop(client_id)

    def _drop(self, client_id: int) -> None:
        state = self.by_client.pop(client_id, None)
        if state is not None:
            self._bytes -= _size(state)

    def _write(self, client_id: int) -> None:
        version, previous = int(self._version[client_id]), int(self._saved[client_id])
        if self.out_dir is None or version == previous:
            return
        save_client_state(self.out_dir, client_id, version, self.by_client[client_id])
        self._saved[client_id] = version
        self._unsynced = True
        if previous == NOT_SAVED:
            return
        if previous > self._last_checkpoint:  # written since the last checkpoint: nothing refers to it
            client_state_path(self.out_dir, client_id, previous).unlink(missing_ok=True)
        else:
            self._superseded.append((client_id, previous, version))

    def _sweep(self, owns) -> None:
        """Of this rank's clients' files: keep those the resumed checkpoint refers to, and the older
        ones an older checkpoint may (removed by `pruned`); remove the others and temporary files."""
        for path in sorted(Path(self.out_dir, CLIENT_STATES).glob("*/*client_*")):
            match = _CLIENT_FILE.match(path.name)
            if match is None or not owns(int(match.group(1))):
                continue
            client_id, version = int(match.group(1)), int(match.group(2))
            referred = self._version_of(self._saved, client_id)
            if match.group(3) is None and version == referred:
                continue
            if match.group(3) is None and version < referred:
                self._superseded.append((client_id, version, referred))
            else:
                path.unlink(missing_ok=True)

    def _grow(self, client_id: int) -> None:
        if client_id >= len(self._version):
            size = max(client_id + 1, 2 * len(self._version))
            self._version = _extended(self._version, size)
            self._saved = _extended(self._saved, size)

    @staticmethod
    def _version_of(versions: np.ndarray, client_id: int) -> int:
        return int(versions[client_id]) if client_id < len(versions) else NOT_SAVED


def _extended(versions: np.ndarray, size: int) -> np.ndarray:
    longer = np.full(size, NOT_SAVED, dtype=np.int32)
    longer[:len(versions)] = versions
    return longer


def _size(state: dict[str, torch.Tensor]) -> int:
    return sum(t.nelement() * t.element_size() for t in state.values())
