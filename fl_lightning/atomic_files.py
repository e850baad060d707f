"""Files replaced atomically: the new content goes to a temporary file beside the target, is synced
to disk (fsync), then renamed over the target, so that a reader, or a run after a crash or a kill,
finds the old file or the complete new one, never a partial write."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable


def replace_atomically(write: Callable[[Path], None], target: Path) -> None:
    """Make the new file through `write(temporary_path)`, then rename it over `target`; the temporary
    file (`.<name>.<pid>.tmp`) is removed whatever happens."""
    target = Path(target)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        write(temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def write_atomically(target: Path, write: Callable[[BinaryIO], None]) -> None:
    """Replace `target` by what `write(file)` writes into a binary file, on disk before the rename."""

    def synced(temporary: Path) -> None:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())

    replace_atomically(synced, target)


def write_text_atomically(target: Path, text: str) -> None:
    write_atomically(target, lambda file: file.write(text.encode()))
