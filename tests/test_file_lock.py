"""FileLock: an exclusive lock taken without waiting, whose file names its holder; a second taker is
refused with LockHeld naming that holder, and the lock of a process that died is free again."""

import errno
import fcntl
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from fl_lightning import file_lock
from fl_lightning.file_lock import FileLock, LockHeld

OURS = f"pid {os.getpid()} on {socket.gethostname()}"
WAIT_S = 30

# Another process that takes the lock with a FileLock of its own, says so on stdout, and holds it until
# its stdin closes or it is killed.
HOLDER = textwrap.dedent("""
    import sys
    from fl_lightning.file_lock import FileLock
    lock = FileLock(sys.argv[1])  # held while the process keeps it
    lock.acquire()
    print("locked", flush=True)
    sys.stdin.read()
""")


@pytest.fixture
def holder(tmp_path):
    """A process holding the lock on tmp_path/run.lock, started and seen to hold it."""
    path = tmp_path / "run.lock"
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([process.stdout], [], [], WAIT_S)
        assert ready and process.stdout.readline() == "locked\n", "the holder did not take the lock"
        yield process, path
    finally:
        process.kill()
        process.wait()
        process.stdin.close()
        process.stdout.close()


def assert_taken_here(path):
    """The lock on `path` is taken by this process, whose line then is the file's whole content."""
    lock = FileLock(path)
    lock.acquire()
    try:
        assert path.read_text() == f"{OURS}\n"
    finally:
        lock.release()


def test_acquire_creates_the_file_and_writes_its_holder(tmp_path):
    lock = FileLock(tmp_path / "run.lock")
    lock.acquire()
    try:
        assert (tmp_path / "run.lock").read_text() == f"{OURS}\n"
    finally:
        lock.release()


def test_acquire_replaces_what_an_earlier_holder_wrote(tmp_path):
    # The file of a holder that is gone stays behind, naming it: the new holder's line replaces it whole.
    path = tmp_path / "run.lock"
    path.write_text("pid 999999 on a-node-with-a-much-longer-name-than-this-one\n")
    assert_taken_here(path)


def test_a_second_lock_on_the_same_file_is_refused_naming_the_first_holder(tmp_path):
    path = tmp_path / "run.lock"
    first, second = FileLock(path), FileLock(path)
    first.acquire()
    try:
        with pytest.raises(LockHeld) as caught:
            second.acquire()
        assert caught.value.holder == OURS
        assert str(caught.value) == f"{path} is held by {OURS}"
        # The refused taker wrote nothing over the holder's line.
        assert path.read_text() == f"{OURS}\n"
    finally:
        first.release()


def test_a_lock_released_can_be_taken_again(tmp_path):
    path = tmp_path / "run.lock"
    first, second = FileLock(path), FileLock(path)
    first.acquire()
    first.release()
    second.acquire()
    try:
        with pytest.raises(LockHeld):
            first.acquire()
    finally:
        second.release()
    first.acquire()
    first.release()


def test_release_without_the_lock_held_does_nothing(tmp_path):
    lock = FileLock(tmp_path / "run.lock")
    lock.release()
    lock.acquire()
    lock.release()
    lock.release()
    # The holder's line stays in the file; only the lock is gone.
    assert lock.path.read_text() == f"{OURS}\n"
    other = FileLock(tmp_path / "run.lock")
    other.acquire()
    other.release()


def test_a_lock_held_by_another_process_names_that_process(holder):
    process, path = holder
    with pytest.raises(LockHeld) as caught:
        FileLock(path).acquire()
    assert caught.value.holder == f"pid {process.pid} on {socket.gethostname()}"


def test_the_lock_of_a_killed_holder_is_free_for_the_next_one(holder):
    # The kernel drops an flock with its process: a killed run leaves no stale lock.
    process, path = holder
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=WAIT_S) == -signal.SIGKILL
    assert path.read_text() == f"pid {process.pid} on {socket.gethostname()}\n"
    assert_taken_here(path)


def test_a_holder_that_wrote_nothing_is_named_another_process(tmp_path):
    path = tmp_path / "run.lock"
    with open(path, "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(LockHeld) as caught:
            FileLock(path).acquire()
    assert caught.value.holder == "another process"
    assert str(caught.value) == f"{path} is held by another process"


def test_a_failure_of_flock_other_than_a_holder_is_raised_as_it_is(tmp_path, monkeypatch):
    def unsupported(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(file_lock.fcntl, "flock", unsupported)
    lock = FileLock(tmp_path / "run.lock")
    with pytest.raises(OSError) as caught:
        lock.acquire()
    assert not isinstance(caught.value, LockHeld)
    assert caught.value.errno == errno.ENOLCK


def test_asking_who_holds_the_lock_takes_it_from_no_one_and_writes_nothing(tmp_path):
    path = tmp_path / "run.lock"
    assert FileLock(path).holder() is None and not path.exists()  # no file: no holder, and none made
    path.write_text("pid 999999 on a node long gone\n")
    assert FileLock(path).holder() is None
    assert path.read_text() == "pid 999999 on a node long gone\n"
    lock = FileLock(path)
    lock.acquire()
    try:
        assert FileLock(path).holder() == OURS
    finally:
        lock.release()
    assert FileLock(path).holder() is None


def test_askers_share_the_lock_and_only_a_holder_refuses_them(tmp_path, monkeypatch):
    """Two sweeps asking at once each see no holder: an asker that took the lock exclusively for an
    instant was seen by the other as the holder of a run it was only looking at."""
    path = tmp_path / "run.lock"
    asking = open(path, "a+")
    fcntl.flock(asking, fcntl.LOCK_SH | fcntl.LOCK_NB)  # another asker, at this instant
    try:
        assert FileLock(path).holder() is None
        with pytest.raises(LockHeld):  # a holder cannot take it meanwhile, as it could not from a holder
            FileLock(path).acquire()
    finally:
        asking.close()


def test_the_holder_named_by_an_asker_is_another_process(holder):
    process, path = holder
    assert FileLock(path).holder() == f"pid {process.pid} on {socket.gethostname()}"
