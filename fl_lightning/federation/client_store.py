"""The per-client state of stateful algorithms (SCAFFOLD's c_i, FedDyn's h_i, MOON's previous model),
kept by each client's owner rank in bounded memory (`compute.client_state_memory_mib`).

States are kept in host memory while they fit the bound, so a small run never touches the disk
between checkpoints. Past the bound, the least recently trained clients' states go to the run
folder's client-state files, one file per client and version: client_states/0001/
client_0001234.r000010.safetensors holds client 1234's state after round 10 (`fl_lightning.checkpoint`).
Files per client rather than memory-mapped arrays per rank: each is written whole, atomically (a
temporary file renamed over it) and with its own digest, so a kill mid-write loses nothing and a
damaged file is refused naming its client; a new version is a new file, so the older one a
checkpoint refers to stays as it was (memory-mapped arrays are written in place: a kill mid-write
would tear the state a checkpoint promised, and keeping versions would mean copying the array);
and the ranks' files never overlap, whatever the number of ranks a resume runs on.

A file is renamed into place whole but not flushed to disk on its own: a checkpoint syncs every file
written since the previous one (`os.sync`, once) before its index and main file, so that a crash of
the machine loses nothing a checkpoint refers to, while a round that writes thousands of states past
the bound costs no disk flush each (a killed process leaves the page cache, and so each file, whole).

A checkpoint writes the states changed since the previous one and, in an index delta of its own, which
clients' files changed (`checkpoint`); its main file lists the deltas that make its whole index, so
what it writes grows with the clients that trained since the previous one, not with the clients of the
federation. A file that a newer version replaces is removed once no kept checkpoint can refer to it
(`pruned`).

The states of the clients about to train that are on disk are read ahead, in a thread, in the order
they will be asked for (`read_ahead`: the rest of this round's, then the next round's, known in advance
as the draw is seeded), so reading them overlaps the training of the clients before them.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fl_lightning.checkpoint import (
    CLIENT_STATES,
    NOT_SAVED,
    client_state_paths,
    extended_versions,
    load_client_state,
    remove_later_client_indexes,
    save_client_index,
    save_client_state,
)

_CLIENT_FILE = re.compile(r"^\.?client_(\d+)\.r(\d+)\.(?:safetensors|pt)(\.\d+\.tmp)?$")
READ_AHEAD_STATES = 64
"""The most states read ahead at a time; and at most a quarter of the bound's bytes."""


class ClientStates:
    """One rank's clients' states: the newest `put` of each client, `get` wherever it lives.

    `by_client` holds the states in memory, least recently trained first. Without `out_dir` every
    state stays in memory; with it, states past `memory_bytes` are written to the client-state files
    and dropped from memory. States put are versioned by `round_completed` (set by the loop each round).
    `index_deltas` are the (round, ranks) of the checkpoints whose index deltas make the index of the
    last one."""

    def __init__(self, initial: Optional[dict] = None, out_dir: Optional[Path] = None,
                 memory_bytes: Optional[int] = None, rank: int = 0):
        self.by_client: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.out_dir, self.memory_bytes, self.rank = out_dir, memory_bytes, rank
        self.round_completed = 0
        self.index_deltas: list[tuple[int, int]] = []
        self._pin = torch.cuda.is_available()
        self._bytes = 0
        self._state_bytes = 0  # of the last state put or read
        self._put_after: dict[int, int] = {}  # the round of each state in memory
        self._saved = np.full(0, NOT_SAVED, dtype=np.int32)  # of its newest file
        self._unindexed = np.zeros(0, dtype=bool)  # its newest file is not in the last checkpoint's index
        self._last_delta = np.zeros(0, dtype=np.int64)  # the clients of the last checkpoint's index delta
        self._last_checkpoint = 0
        self._unsynced = False  # a file was written since the last sync
        self._superseded = _Superseded()
        self._upcoming: Iterator[int] = iter(())  # clients to read ahead, in the order they will train
        self._ahead: dict[int, tuple[int, Future]] = {}  # client -> (version, its reading)
        self._reader: Optional[ThreadPoolExecutor] = None
        for client_id, state in (initial or {}).items():
            self.put(client_id, state)

    @classmethod
    def resumed(cls, out_dir: Path, memory_bytes: Optional[int], round_completed: int, saved: Mapping,
                rank: int, world_size: int, index_deltas: Optional[list] = None,
                num_clients: int = 0) -> "ClientStates":
        """Rank `rank`'s store (its clients: client id mod `world_size`) of a run resumed after
        `round_completed` (0: a new run) from a checkpoint's client states `saved`
        (`fl_lightning.checkpoint.ClientStateFiles`, or the states themselves in a checkpoint of an
        earlier version) and its `index_deltas` (None in a checkpoint of an earlier version: the next
        checkpoint writes a whole index), its versions kept for `num_clients` clients from the start (no
        copies as they grow); its files the checkpoint does not refer to (written after it by a run
        killed later, or temporary files) are removed."""
        store = cls(out_dir=out_dir, memory_bytes=memory_bytes, rank=rank)
        store.round_completed = store._last_checkpoint = round_completed
        store.index_deltas = [tuple(delta) for delta in index_deltas or []]
        versions = getattr(saved, "versions", None)
        if versions is not None:
            owned = np.arange(len(versions)) % world_size == rank
            store._saved = np.where(owned, versions, NOT_SAVED).astype(np.int32)
            store._unindexed = (np.zeros(len(versions), dtype=bool) if index_deltas is not None
                                else store._saved != NOT_SAVED)
        store._reserve(num_clients)
        store._sweep(lambda client_id: client_id % world_size == rank)
        if rank == 0:
            remove_later_client_indexes(out_dir, round_completed)
        if versions is None:
            for client_id, state in saved.items():
                if client_id % world_size == rank:
                    store.put(client_id, state)
        return store

    def get(self, client_id: int, device: torch.device) -> dict[str, torch.Tensor]:
        state = self.by_client.get(client_id)
        ahead = self._ahead.pop(client_id, None)
        version = self._version_of(self._saved, client_id)
        if state is None and version != NOT_SAVED:
            # A reading is of the file current when it started: one since replaced is read again.
            read = ahead is not None and ahead[0] == version
            state = ahead[1].result() if read else load_client_state(self.out_dir, client_id, version)
            self._state_bytes = _size(state)
        self._read_upcoming()
        return {k: v.to(device, non_blocking=True) for k, v in (state or {}).items()}

    def put(self, client_id: int, state: dict[str, torch.Tensor]) -> None:
        stored = {}
        for name, value in state.items():
            host = value.detach().to("cpu", copy=True)
            stored[name] = host.pin_memory() if self._pin else host
        self._drop(client_id)
        self.by_client[client_id] = stored
        self._state_bytes = _size(stored)
        self._bytes += self._state_bytes
        self._grow(client_id)
        self._put_after[client_id] = self.round_completed
        while self._over_bound() and len(self.by_client) > 1:
            self._evict(next(iter(self.by_client)))

    def read_ahead(self, client_ids: Iterable[int]) -> None:
        """Read, in the background, the states on disk of `client_ids` (those about to train, in the
        order they will: taken one by one as the window moves, never all at once), a window of them at
        a time; what was being read for clients not among the window's first is let go."""
        if self.out_dir is None:
            return
        upcoming = iter(client_ids)
        first = list(itertools.islice(upcoming, self._read_window()))
        for client_id in [c for c in self._ahead if c not in first]:
            self._ahead.pop(client_id)[1].cancel()
        self._upcoming = itertools.chain(first, upcoming)
        self._read_upcoming()

    def checkpoint(self, round_completed: int, ranks: int) -> None:
        """Write the states changed since the last checkpoint, sync every file written since (one
        `os.sync` rather than a flush a file), then this rank's index delta of the checkpoint (`ranks`:
        how many ranks write one)."""
        for client_id in self.by_client:
            self._write(client_id)
        if self._unsynced:
            os.sync()
            self._unsynced = False
        self._last_checkpoint = round_completed
        changed = np.flatnonzero(self._unindexed)
        if self.index_deltas and self.index_deltas[-1][0] == round_completed:  # the same round again
            changed = np.union1d(self._last_delta, changed)
            self.index_deltas.pop()
        save_client_index(self.out_dir, round_completed, self.rank, changed.astype(np.int32),
                          self._saved[changed])
        self._unindexed[changed] = False
        self._last_delta = changed
        self.index_deltas.append((round_completed, ranks))

    def pruned(self, kept_rounds: list[int]) -> None:
        """Remove the files replaced by a version that every kept checkpoint (`kept_rounds`) refers to."""
        clients, versions = self._superseded.pop_replaced_by(min(kept_rounds, default=self._last_checkpoint))
        for client_id, version in zip(clients, versions):  # one by one: no list of every file removed
            _remove(self.out_dir, int(client_id), int(version))

    def _read_window(self) -> int:
        """How many states to read ahead: a quarter of the bound's worth, at most READ_AHEAD_STATES; one
        while no state's size is known, or without a bound."""
        if not self._state_bytes or self.memory_bytes is None:
            return 1
        return max(1, min(READ_AHEAD_STATES, self.memory_bytes // 4 // self._state_bytes))

    def _read_upcoming(self) -> None:
        window = self._read_window()
        while len(self._ahead) < window:
            client_id = next(self._upcoming, None)
            if client_id is None:
                return
            version = self._version_of(self._saved, client_id)
            if client_id in self.by_client or client_id in self._ahead or version == NOT_SAVED:
                continue
            if self._reader is None:
                self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="client-state-reader")
            self._ahead[client_id] = (version, self._reader.submit(load_client_state, self.out_dir, client_id,
                                                                   version))

    def _over_bound(self) -> bool:
        return self.out_dir is not None and self.memory_bytes is not None and self._bytes > self.memory_bytes

    def _evict(self, client_id: int) -> None:
        self._write(client_id)
        self._drop(client_id)

    def _drop(self, client_id: int) -> None:
        state = self.by_client.pop(client_id, None)
        self._put_after.pop(client_id, None)
        if state is not None:
            self._bytes -= _size(state)

    def _write(self, client_id: int) -> None:
        version, previous = self._put_after[client_id], int(self._saved[client_id])
        if self.out_dir is None or version == previous:
            return
        save_client_state(self.out_dir, client_id, version, self.by_client[client_id])
        self._saved[client_id] = version
        self._unindexed[client_id] = self._unsynced = True
        if previous == NOT_SAVED:
            return
        if previous > self._last_checkpoint:  # written since the last checkpoint: nothing refers to it
            _remove(self.out_dir, client_id, previous)
        else:
            self._superseded.append(client_id, previous, version)

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
                self._superseded.append(client_id, version, referred)
            else:
                path.unlink(missing_ok=True)

    def _grow(self, client_id: int) -> None:
        if client_id >= len(self._saved):
            self._reserve(max(client_id + 1, 2 * len(self._saved)))

    def _reserve(self, size: int) -> None:
        if size > len(self._saved):
            self._saved = extended_versions(self._saved, size)
            self._unindexed = np.concatenate([self._unindexed, np.zeros(size - len(self._unindexed), dtype=bool)])

    @staticmethod
    def _version_of(versions: np.ndarray, client_id: int) -> int:
        return int(versions[client_id]) if client_id < len(versions) else NOT_SAVED


class _Superseded:
    """Files a newer version replaced, kept while a checkpoint may refer to them: (client, version,
    replaced by version), 12 bytes each where a tuple of ints would take about 150; between two
    checkpoints of a large federation there are as many as the clients that trained."""

    def __init__(self):
        self.clients, self.versions, self.replaced_by = (array.array("i") for _ in range(3))

    def append(self, client_id: int, version: int, replaced_by: int) -> None:
        self.clients.append(client_id)
        self.versions.append(version)
        self.replaced_by.append(replaced_by)

    def pop_replaced_by(self, round_completed: int) -> tuple[np.ndarray, np.ndarray]:
        """The clients and versions of the files replaced by a version of `round_completed` or earlier,
        no longer kept here."""
        columns = [np.frombuffer(column, dtype=np.int32) for column in (self.clients, self.versions, self.replaced_by)]
        gone = columns[2] <= round_completed
        popped = columns[0][gone], columns[1][gone]
        self.clients, self.versions, self.replaced_by = (array.array("i", column[~gone].tobytes())
                                                         for column in columns)
        return popped


def _remove(out_dir: Path, client_id: int, version: int) -> None:
    for path in client_state_paths(out_dir, client_id, version):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _size(state: dict[str, torch.Tensor]) -> int:
    return sum(t.nelement() * t.element_size() for t in state.values())
