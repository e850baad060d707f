"""Start-up time of the command line: how long `fl-lightning fit --help` and a bad-input error take,
wall clock, each in a fresh process, against `python -c "import torch"` (the floor: the parser needs
the classes in fit's signature, and those import torch).

    .venv/bin/python benchmarks/startup.py [--repeats 7]

Prints the median, min and max of each over the repetitions (after one unmeasured warm-up run that
fills the file-system cache).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
QUICKSTART = REPOSITORY / "configs" / "quickstart.yaml"


def fl_lightning_command() -> list[str]:
    """The installed `fl-lightning` script beside this interpreter, as users run it."""
    script = Path(sys.executable).parent / "fl-lightning"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fl_lightning.cli"]


def timed(command: list[str], expected_status: int, repeats: int) -> list[float]:
    seconds = []
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        completed = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        if completed.returncode != expected_status:
            raise SystemExit(f"{' '.join(command)} exited {completed.returncode}, not {expected_status}:\n"
                             f"{completed.stderr[-2000:]}")
        if attempt > 0:  # the first run only warms the file-system cache
            seconds.append(elapsed)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="measured runs of each command")
    args = parser.parse_args()

    fl_lightning = fl_lightning_command()
    with tempfile.TemporaryDirectory() as scratch:
        cases = [
            ('python -c "import torch"', [sys.executable, "-c", "import torch"], 0),
            ("fl-lightning fit --help", [*fl_lightning, "fit", "--help"], 0),
            ("fl-lightning fit (bad input)",
             [*fl_lightning, "fit", "--config", str(QUICKSTART), "--out_dir", os.path.join(scratch, "run"),
              "--federation.clients_per_round", "0"], 2),
        ]
        print(f"{os.cpu_count()} CPUs, {args.repeats} runs each (wall seconds, one process per run)")
        print(f"{'command':32} {'median':>8} {'min':>8} {'max':>8}")
        for label, command, status in cases:
            seconds = timed(command, status, args.repeats)
            print(f"{label:32} {statistics.median(seconds):8.2f} {min(seconds):8.2f} {max(seconds):8.2f}")


if __name__ == "__main__":
    main()
