"""Atomic replacement of a file: the target holds its old content or the complete new one, never a part;
the temporary file beside it never outlives the call; and write failures of the file system come out
as WriteFailed naming the target, while other errors pass through as they are."""

import errno
import os
from pathlib import Path

import pytest

from fl_lightning import atomic_files
from fl_lightning.atomic_files import (
    failures_reported_as_writes_of,
    os_error_in,
    replace_atomically,
    write_atomically,
    write_text_atomically,
)
from fl_lightning.errors import RunInterrupted, WriteFailed


def test_write_text_atomically_creates_the_file_and_leaves_nothing_else(tmp_path):
    target = tmp_path / "state.json"
    write_text_atomically(target, '{"round": 3} ü')
    assert target.read_bytes() == '{"round": 3} ü'.encode()
    assert os.listdir(tmp_path) == ["state.json"]


def test_write_atomically_replaces_an_existing_file_whole(tmp_path):
    target = tmp_path / "weights.bin"
    target.write_bytes(b"old content that is longer than the new one")

    def write(file):
        file.write(b"new")
        file.write(b"!")

    write_atomically(target, write)
    assert target.read_bytes() == b"new!"
    assert os.listdir(tmp_path) == ["weights.bin"]


def test_the_new_content_goes_to_a_hidden_temporary_beside_the_target_while_the_target_stays_old(tmp_path):
    target = tmp_path / "metrics.jsonl"
    target.write_text("old\n")
    seen = {}

    def write(temporary):
        Path(temporary).write_text("new\n")
        seen["temporary"] = Path(temporary)
        # A reader during the write still finds the old file whole.
        seen["target during the write"] = target.read_text()

    replace_atomically(write, target)
    # Beside the target, so that the rename stays within one file system; its pid keeps two writers apart.
    assert seen["temporary"] == tmp_path / f".metrics.jsonl.{os.getpid()}.tmp"
    assert seen["target during the write"] == "old\n"
    assert target.read_text() == "new\n"
    assert not seen["temporary"].exists()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"complete old checkpoint")

    def half_written(file):
        file.write(b"half of the new")
        raise KeyError("the serialiser failed")

    # Not a failure of the file system: the error comes out as it is.
    with pytest.raises(KeyError, match="the serialiser failed"):
        write_atomically(target, half_written)
    assert target.read_bytes() == b"complete old checkpoint"
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_a_write_that_fails_before_making_the_temporary_raises_its_own_error(tmp_path):
    # The temporary is removed only if it exists: its absence must not hide the write's error.
    def nothing_written(temporary):
        raise ValueError("refused before writing")

    with pytest.raises(ValueError, match="refused before writing"):
        replace_atomically(nothing_written, tmp_path / "never.txt")
    assert os.listdir(tmp_path) == []


def test_a_full_disk_is_reported_as_write_failed_naming_the_target_with_its_remedy(tmp_path):
    target = tmp_path / "partition.json"
    target.write_text("old")

    def disk_full(file):
        file.write(b"par")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(WriteFailed) as caught:
        write_atomically(target, disk_full)
    assert str(caught.value) == f"cannot write {target} ({os.strerror(errno.ENOSPC)})"
    assert caught.value.remedy == "free space on its file system"
    assert caught.value.__cause__.errno == errno.ENOSPC
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["partition.json"]


def test_a_failed_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "config.yaml"
    target.write_text("rounds: 1\n")

    def read_only_rename(source, destination):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(destination))

    monkeypatch.setattr(atomic_files.os, "replace", read_only_rename)
    with pytest.raises(WriteFailed) as caught:
        write_text_atomically(target, "rounds: 2\n")
    assert str(target) in str(caught.value)
    assert caught.value.remedy == "make its folder writable (its file system is mounted read-only)"
    assert target.read_text() == "rounds: 1\n"
    assert os.listdir(tmp_path) == ["config.yaml"]


def test_the_content_is_synced_to_disk_before_the_rename(tmp_path, monkeypatch):
    target = tmp_path / "data.bin"
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor):
        # How much the file holds when it is synced: all of the content, already flushed.
        events.append(("fsync", os.fstat(descriptor).st_size))
        real_fsync(descriptor)

    def replace(source, destination):
        events.append(("replace", destination))
        real_replace(source, destination)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_atomically(target, lambda file: file.write(b"abc" * 10))
    assert events == [("fsync", 30), ("replace", target)]


def test_an_error_whose_context_is_an_os_error_is_reported_as_write_failed(tmp_path):
    # torch.save wraps the OSError of a full disk in a RuntimeError of its own.
    target = tmp_path / "model.pt"
    with pytest.raises(WriteFailed) as caught:
        with failures_reported_as_writes_of(target):
            try:
                raise OSError(errno.EDQUOT, "Disk quota exceeded")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos")  # noqa: B904 (as torch's)
    assert str(caught.value) == f"cannot write {target} (Disk quota exceeded)"
    assert caught.value.remedy == "free space within your disk quota"
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_run_interrupted_passes_through_even_when_an_os_error_caused_it(tmp_path):
    # A WriteFailed for another file raised inside must keep naming that file, not be wrapped again.
    other = WriteFailed(tmp_path / "other.txt", OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(WriteFailed) as caught:
        with failures_reported_as_writes_of(tmp_path / "outer.txt"):
            try:
                raise OSError(errno.EIO, "Input/output error")
            except OSError:
                raise other  # noqa: B904 (its context is the OSError on purpose)
    assert caught.value is other
    assert "other.txt" in str(caught.value) and "outer.txt" not in str(caught.value)


def test_errors_unrelated_to_the_file_system_pass_through_unchanged(tmp_path):
    problem = TypeError("not serialisable")
    with pytest.raises(TypeError) as caught:
        with failures_reported_as_writes_of(tmp_path / "x"):
            raise problem
    assert caught.value is problem


def test_os_error_in_finds_the_os_error_itself_or_in_the_chain_of_causes_and_contexts():
    direct = FileNotFoundError(errno.ENOENT, "No such file or directory")
    assert os_error_in(direct) is direct

    caused = RuntimeError("wrapped")
    caused.__cause__ = direct
    assert os_error_in(caused) is direct

    deeper = ValueError("outer")
    deeper.__context__ = caused
    assert os_error_in(deeper) is direct

    assert os_error_in(ValueError("no cause")) is None
    assert os_error_in(RunInterrupted("gone")) is None


def test_os_error_in_prefers_the_cause_to_the_context():
    err = RuntimeError("both")
    err.__cause__ = ValueError("the explicit cause")
    err.__context__ = OSError(errno.EIO, "only the context")
    # `raise ... from` names the cause: the context is what was being handled, not what went wrong.
    assert os_error_in(err) is None


def test_os_error_in_stops_on_a_cycle_of_contexts():
    first, second = ValueError("first"), KeyError("second")
    first.__context__, second.__context__ = second, first
    assert os_error_in(first) is None
