"""`python -m fl_lightning.cli.peak_memory REPORT ARGS...`: `fl-lightning ARGS`, then the process's peak
memory written to REPORT as JSON (`{"peak_bytes": ...}`): how `fl-lightning sweep --estimate` measures
what one of a plan's runs needs."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Optional

from fl_lightning.cli.main import main as fl_lightning


def peak_bytes() -> int:
    """This process's peak memory: its GPU's on a GPU, else the largest resident set of it and of the
    processes it waited for (its ranks); Linux reports maxrss in KiB."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return 1024 * max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)


def main(argv: Optional[list[str]] = None) -> None:
    report, *arguments = list(sys.argv[1:] if argv is None else argv)
    fl_lightning(arguments)
    Path(report).write_text(json.dumps({"peak_bytes": peak_bytes()}))


if __name__ == "__main__":
    main()
