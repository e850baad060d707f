"""An exclusive lock on a file, which names its holder, and who holds it, asked without taking it: the
lock of a run folder, and of a dataset's download in data.root."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import Optional

from fl_lightning.atomic_files import failures_reported_as_writes_of


class LockHeld(Exception):
    """Another process holds the lock."""

    def __init__(self, holder: str, path: Path):
        super().__init__(f"{path} is held by {holder}")
        self.holder = holder
        """`pid 1234 on host`, as the holder wrote it (or "another process")."""


class FileLock:
    """An flock on `path` (created when missing), taken without waiting; while held, the file holds
    `pid <pid> on <host>`. The kernel drops it when the process dies, so a killed holder leaves no
    stale lock behind; on NFS, Linux takes it on the server, so it holds across nodes."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = None

    def acquire(self) -> None:
        """Take the lock, or raise LockHeld naming its holder."""
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            try:
                holder = _holder_refusing(handle, err)
            finally:
                handle.close()
            raise LockHeld(holder, self.path) from err
        self._file = handle
        with failures_reported_as_writes_of(self.path):
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            handle.flush()

    def holder(self) -> Optional[str]:
        """Who holds the lock now, or None; asked without taking the lock from anyone and without
        writing: a shared lock for an instant, which other askers share and only a holder refuses."""
        try:
            handle = open(self.path)
        except FileNotFoundError:
            return None
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as err:
                return _holder_refusing(handle, err)
        return None

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _holder_refusing(handle, err: OSError) -> str:
    """Who holds the lock that refused `handle` its flock (`err`): the line the holder wrote, or
    "another process" before it has written one; any other failure of flock is raised as it is."""
    if err.errno not in (errno.EAGAIN, errno.EACCES):
        raise err
    handle.seek(0)
    return handle.read().strip() or "another process"
