"""Downloads into data.root that many processes may ask for at once: the ranks of a job, the tasks of
an array job, on one node or on several that share data.root over NFS.

A dataset's download, its extraction and what is derived from it (Tiny-ImageNet's decoded cache)
are done under an exclusive lock, `data.root/.<folder>.lock` (an flock: fl_lightning.file_lock): the
first process to take it downloads, the others wait for it and then find the dataset there. The
kernel drops the lock of a process that dies, so a crashed download never blocks the next one, and
Linux's NFS client hands flock to the server, so processes on other nodes wait as well.

The archive is downloaded and extracted into a folder of its own process,
`data.root/.<folder>.part.<host>.<pid>`, and the dataset's folder is renamed into place once it is
whole: a reader finds the whole folder or none, also when two processes download at once (an NFS
mount whose locks stay on each node, `nolock` or `local_lock`). The next process to take the lock
removes the part folders whose process is gone (each is locked by its own while it lives).

A process holding the lock touches its file every HEARTBEAT_S seconds. A waiter that sees the file
unchanged for STALE_S seconds takes its holder for one that will not finish, although its lock stays
held (a job suspended with SIGSTOP; a node that crashed on NFSv3, whose locks the server keeps until
the node restarts), and goes on without the lock: it downloads into a part folder of its own, and
the rename keeps every reader off a folder that is not whole.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from fl_lightning.errors import ConfigError
from fl_lightning.file_lock import FileLock, LockHeld

HEARTBEAT_S = 30.0
STALE_S = 300.0
"""Ten heartbeats: far more than NFS takes to show another node's change of a file's time (its
attribute cache holds times for at most 60 s by default)."""
POLL_S = 1.0
"""How often a waiter tries the lock again."""
PART = ".part."
LOCK = ".lock"
"""A part folder's lock, held by the process downloading into it."""


class DatasetLock:
    """`with DatasetLock(root, folder):` holds the lock of root/folder's download and preparation, waiting
    for another holder as long as it shows signs of life (see the module docstring)."""

    def __init__(self, root: Path, folder: str):
        self.root = Path(root)
        self.path = self.root / f".{folder}.lock"
        self._lock = FileLock(self.path)
        self._stop_heartbeat = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None

    def __enter__(self) -> DatasetLock:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            held = self._wait()
        except OSError as err:
            raise ConfigError("data.root", "a folder this process can create and write (for the lock of a "
                              "dataset's download and decoding)", f"{self.root} ({err.strerror})") from err
        if held:
            self._heartbeat = threading.Thread(target=self._beat, name="dataset lock heartbeat", daemon=True)
            self._heartbeat.start()
        return self

    def __exit__(self, *exception) -> None:
        if self._heartbeat is not None:
            self._stop_heartbeat.set()
            self._heartbeat.join()
        self._lock.release()

    def _wait(self) -> bool:
        """Take the lock: True once held, False when its holder is taken for stale."""
        told = False
        stamp, since = None, time.monotonic()
        while True:
            try:
                self._lock.acquire()
                return True
            except LockHeld as held:
                holder = held.holder
            if not told:
                print(f"waiting for {holder}, which holds {self.path} (downloading or preparing the dataset)",
                      flush=True)
                told = True
            seen = _modified(self.path)
            if seen != stamp:
                stamp, since = seen, time.monotonic()
            elif time.monotonic() - since >= STALE_S:
                print(f"warning: {holder} holds {self.path} but has shown no sign of life for {STALE_S:.0f} s (a "
                      "suspended job or a crashed node?); going on without the lock", file=sys.stderr, flush=True)
                return False
            time.sleep(POLL_S)

    def _beat(self) -> None:
        while not self._stop_heartbeat.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # a file system gone away: the waiters will take the lock for stale
                pass


def _modified(path: Path) -> Optional[int]:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def fetch_folder(url: str, md5: Optional[str], root: Path, folder: str, lacking: Callable[[Path], list[str]],
                 layout: str) -> None:
    """Download the archive at `url` (checked against `md5`), extract it into this process's part
    folder and rename the `folder` it holds to root/folder, once `lacking(that folder)` finds nothing
    missing. Call it holding the DatasetLock of root/folder; when root/folder appears meanwhile (a
    process that went on without the lock), that one stays and this copy is dropped."""
    from torchvision.datasets.utils import calculate_md5, download_url, extract_archive

    _remove_abandoned_parts(root, folder)
    with _PartFolder(root, folder) as part:
        print(f"downloading {url} into {root}", flush=True)
        try:
            download_url(url, str(part))
        except Exception as err:  # urllib, socket and file-system errors alike; offline, the usual cause
            raise ConfigError("data.download", f"a network connection to download {url} into {root} (or the "
                              "dataset already there)", f"{type(err).__name__}: {err}") from err
        archive = part / os.path.basename(url)
        digest = None if md5 is None else calculate_md5(archive)
        if digest != md5:
            raise ConfigError("data.download", f"the archive at {url} with md5 {md5}",
                              f"{archive} with md5 {digest} (a damaged or changed download)")
        try:
            extract_archive(str(archive), str(part))
        except Exception as err:  # tarfile, zipfile, gzip and file-system errors alike
            raise ConfigError("data.download", f"an archive at {url} that extracts whole",
                              f"{archive} ({type(err).__name__}: {err})") from err
        extracted = part / folder
        absent = lacking(extracted)
        if absent:
            raise ConfigError("data.download", f"an archive at {url} holding {folder}/ with {layout}",
                              f"one whose {folder}/ lacks {', '.join(absent)}")
        try:
            os.rename(extracted, root / folder)
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise ConfigError("data.root", f"a folder to move {folder}/ into", f"{root} ({err.strerror})") from err


class _PartFolder:
    """root/.<folder>.part.<host>.<pid>: where this process downloads and extracts, locked by it while
    it lives and removed when it is done."""

    def __init__(self, root: Path, folder: str):
        self.path = root / f".{folder}{PART}{socket.gethostname()}.{os.getpid()}"
        self._lock = FileLock(self.path / LOCK)

    def __enter__(self) -> Path:
        shutil.rmtree(self.path, ignore_errors=True)  # an earlier process's, of this pid: gone
        try:
            self.path.mkdir()
            self._lock.acquire()
        except OSError as err:
            raise ConfigError("data.root", "a folder this process can write (to download a dataset into)",
                              f"{self.path.parent} ({err.strerror})") from err
        return self.path

    def __exit__(self, *exception) -> None:
        self._lock.release()
        shutil.rmtree(self.path, ignore_errors=True)


def _remove_abandoned_parts(root: Path, folder: str) -> None:
    """Remove the part folders of root/folder whose process is gone: their lock is free."""
    for part in root.glob(f".{folder}{PART}*"):
        lock = FileLock(part / LOCK)
        try:
            lock.acquire()
        except (LockHeld, OSError):  # in use, or not a part folder this process may touch
            continue
        lock.release()
        shutil.rmtree(part, ignore_errors=True)
