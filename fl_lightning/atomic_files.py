"""Files replaced atomically: the new content goes to a temporary file beside the target, is synced
to disk (fsync), then renamed over the target, so that a reader, or a run after a crash or a kill,
finds the old file or the complete new one, never a partial write.

A write that fails for a cause of the file system (a full disk, a read-only folder) raises
`WriteFailed` naming the file; the old file is left as it was, and no temporary file is left."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional, Union

from fl_lightning.errors import RunInterrupted, WriteFailed


def replace_atomically(write: Callable[[str], None], target: Union[str, os.PathLike]) -> None:
    """Make the new file through `write(temporary_path)`, then rename it over `target`; the temporary
    file (`.<name>.<pid>.tmp`, its path a string) is removed whatever happens.

    Paths are strings here, not pathlib objects: Python 3.11's pathlib interns every part of every
    path it parses, and a client-state store past its bound writes a file of a new name for each
    client of a round, which would grow the interpreter's table of interned strings by megabytes."""
    directory, name = os.path.split(os.fspath(target))
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    with failures_reported_as_writes_of(target):
        try:
            write(temporary)
            os.replace(temporary, target)
        finally:
            if os.path.lexists(temporary):  # a read-only file system refuses to unlink even a missing file
                os.unlink(temporary)


def write_atomically(target: Union[str, os.PathLike], write: Callable[[BinaryIO], None], synced: bool = True) -> None:
    """Replace `target` by what `write(file)` writes into a binary file, on disk before the rename.
    `synced=False` leaves it to the caller to sync (`os.sync`) before anything depends on the file
    surviving a crash of the machine: a process killed at any moment still leaves the old file or the
    new one whole, and writing many small files costs no disk flush each."""

    def written(temporary: str) -> None:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            if synced:
                os.fsync(file.fileno())

    replace_atomically(written, target)


def write_text_atomically(target: Path, text: str) -> None:
    write_atomically(target, lambda file: file.write(text.encode()))


@contextlib.contextmanager
def failures_reported_as_writes_of(path: Path) -> Iterator[None]:
    """An OSError raised while writing `path` as WriteFailed naming it, also when the writer wrapped
    it in an error of its own (torch.save raises a RuntimeError whose context is the OSError)."""
    try:
        yield
    except RunInterrupted:
        raise
    except Exception as err:
        cause = os_error_in(err)
        if cause is None:
            raise
        raise WriteFailed(path, cause) from err


def os_error_in(err: BaseException) -> Optional[OSError]:
    """The OSError that `err` is, or that caused it (its chain of causes and contexts), or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None
