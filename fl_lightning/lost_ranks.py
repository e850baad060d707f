"""A rank that is gone, named by the ranks left.

When a rank's process dies (killed, out of memory, its node down), gloo raises a RuntimeError on
the ranks left at their next collective, `Connection closed by peer [10.0.0.2]:41232`: it names the
peer's address, not its rank, and on one node every rank has the same address. So every rank tells
the others its host and pid when the run starts (`RankProcesses.gather`), and a rank left looks
among them for the one that is gone (`RankProcesses.lost`).

Ranks that Fabric's launcher starts (`fabric.devices` > 1 on one node, outside Slurm and torchrun)
are children of rank 0, which Lightning watches: the moment one ends, it kills every rank, rank 0
included, so that rank 0 said nothing but Lightning's `Child process ... terminated` and died of
SIGKILL. `watch_started_ranks` has it wait instead, up to the process group's timeout (what a
collective with a dead peer would wait anyway), for rank 0 to end by itself, as its next collective
fails and it names the rank that is gone; only a rank 0 still running then is killed, as before.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from fl_lightning.errors import RankLost

# What gloo says on the ranks left when a peer's connection ends (pair.cc: a closed connection, or a
# read or write error on it), and the peer's address it names.
PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe")
PEER_ADDRESS = re.compile(r"\[[^\]]*\]:\d+")


@dataclass(frozen=True)
class RankProcess:
    rank: int
    host: str
    pid: int

    def __str__(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.host})"


@dataclass(frozen=True)
class RankProcesses:
    """Every rank's process, and which of them this one is."""

    processes: list[RankProcess]
    own_rank: int

    @classmethod
    def gather(cls, engine) -> "RankProcesses":
        """Collective: each rank's host and pid, told to every rank (nothing to tell on one rank)."""
        own = RankProcess(engine.global_rank, socket.gethostname(), os.getpid())
        processes = [own]
        if engine.world_size > 1:
            processes = [None] * engine.world_size
            torch.distributed.all_gather_object(processes, own)
        return cls(processes, engine.global_rank)

    def lost(self, err: BaseException, round_number: int) -> Optional[RankLost]:
        """RankLost naming the rank that is gone, when `err` is a collective's failure for a peer gone
        during round `round_number`; None for any other error."""
        found = PEER_GONE.search(str(err)) if isinstance(err, RuntimeError) else None
        if found is None or len(self.processes) == 1:
            return None
        address = PEER_ADDRESS.search(str(err))
        return RankLost(f"round {round_number}: {self._gone()} (gloo: {found.group(0)}"
                        f"{'' if address is None else ' ' + address.group(0)})")

    def _gone(self) -> str:
        """The rank that is gone: the only other one, or those of this host whose process has ended;
        a rank of another host cannot be looked for (the gloo message gives its address)."""
        own = self.processes[self.own_rank]
        others = [process for process in self.processes if process.rank != own.rank]
        ended = [process for process in others if process.host == own.host and not _is_running(process.pid)]
        if len(others) == 1 or len(ended) == 1:
            return f"{(ended or others)[0]} is gone"
        if ended:
            return f"{', '.join(map(str, ended))} are gone"
        return "a rank of another host is gone"


def _is_running(pid: int) -> bool:
    """Whether process `pid` of this host runs: it exists and is no zombie (a killed process its
    parent has not yet waited for)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    if not Path("/proc").is_dir():
        return True  # no /proc to tell a zombie by (macOS)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False  # it ended just now
    return state not in ("Z", "X")


def watch_started_ranks(grace_seconds: float) -> None:
    """Give rank 0 `grace_seconds` to end by itself once a rank Fabric's launcher started has ended
    (see the module's docstring). Lightning builds its watcher from the module attribute replaced here."""
    from lightning.fabric.strategies.launchers import subprocess_script

    class PatientObserver(subprocess_script._ChildProcessObserver):
        """Lightning's check of the children, run every few seconds, kills every rank only
        `grace_seconds` after a child ended with an error."""

        ended_at: Optional[float] = None

        def _run(self) -> bool:
            codes = [process.poll() for process in self._child_processes]
            if all(code == 0 for code in codes):
                return True
            if not any(codes):  # running, or ended well
                return False
            self.ended_at = self.ended_at or time.monotonic()
            if time.monotonic() - self.ended_at < grace_seconds:
                return False
            self._terminate_all()
            return True

    subprocess_script._ChildProcessObserver = PatientObserver
