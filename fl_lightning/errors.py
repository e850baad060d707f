"""Errors that any layer may raise: the bottom of the import graph, importing nothing of the package."""

from __future__ import annotations

import errno
import os


class ConfigError(ValueError):
    """A setting that cannot work; the message names the field and what was expected."""

    def __init__(self, field_name: str, expected: str, got: object):
        super().__init__(f"{field_name}: expected {expected}, got {got!r}")
        self.field_name = field_name


class RunWarning(UserWarning):
    """A warning of fl-lightning's own, on what it found and did about it (a damaged checkpoint passed
    over, W&B logging offline): the command line prints it as one line, `warning: <text>`
    (`fl_lightning.cli.messages.one_line_warnings`), as it prints its errors."""


class RunInterrupted(RuntimeError):
    """The run cannot go on for a cause outside its settings (a file it cannot write, a rank that is
    gone). What it saved is whole, and the same command resumes from its last good checkpoint: `fit`
    completes the message with it (`advice`). The command exits with `exit_status`."""

    exit_status = 1

    def __init__(self, what: str, remedy: str = ""):
        super().__init__(what)
        self.what = what
        self.remedy = remedy
        """What to do before running the command again ("free space on its file system"), or nothing."""
        self.advice = ""
        """Which checkpoint the same command resumes from, once `fit` has said it."""

    def __str__(self) -> str:
        return f"{self.what}; {self.advice}" if self.advice else self.what


# Write failures that the user puts right before running the command again, and how.
_REMEDIES = {errno.ENOSPC: "free space on its file system", errno.EDQUOT: "free space within your disk quota",
             errno.EACCES: "make its folder writable", errno.EPERM: "make its folder writable",
             errno.EROFS: "make its folder writable (its file system is mounted read-only)"}
UNWRITABLE_ERRNOS = frozenset(_REMEDIES)
"""The errors of a file system that cannot take a run's files (full, over quota, read-only)."""


class WriteFailed(RunInterrupted):
    """A file of the run that could not be written: a full disk, a read-only folder."""

    exit_status = 74  # EX_IOERR of sysexits.h: an input/output error on a file

    def __init__(self, path: os.PathLike, cause: OSError):
        super().__init__(f"cannot write {path} ({cause.strerror or cause})", _REMEDIES.get(cause.errno, ""))


class RankLost(RunInterrupted):
    """Another rank of the run is gone (its process died, its node went down) while this one needed it."""

    exit_status = 75  # EX_TEMPFAIL of sysexits.h: a temporary failure, the same command may be run again
