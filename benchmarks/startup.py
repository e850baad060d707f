"""Start-up time of the command line: how long `fl-lightning fit --help` and a bad-input error take,
each in a fresh process, against `python -c "import torch"` (the floor: the parser needs the classes
in fit's signature, and those import torch).

    .venv/bin/python benchmarks/startup.py [--repeats 7]

Prints the median and min of each over the repetitions (after one unmeasured warm-up run that fills
the file-system cache), in wall seconds and in CPU seconds (user + system of the process and its
children): on a machine that others share, the CPU seconds and the minimum vary least.
"""

from __future__ import annotations

import argparse
import os
import resource
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
    return [str(script)] if script.exists() else [sys.executable, "-m", "fl_lightning"]


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str], expected_status: int, repeats: int) -> tuple[list[float], list[float]]:
    """Wall seconds and CPU seconds of each measured run."""
    wall, cpu = [], []
    for attempt in range(repeats + 1):
        start, start_cpu = time.perf_counter(), children_cpu_seconds()
        completed = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True)
        elapsed, elapsed_cpu = time.perf_counter() - start, children_cpu_seconds() - start_cpu
        if completed.returncode != expected_status:
            raise SystemExit(f"{' '.join(command)} exited {completed.returncode}, not {expected_status}:\n"
                             f"{completed.stderr[-2000:]}")
        if attempt > 0:  # the first run only warms the file-system cache
            wall.append(elapsed)
            cpu.append(elapsed_cpu)
    return wall, cpu


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
        print(f"{os.cpu_count()} CPUs, {args.repeats} runs each (seconds, one process per run)")
        print(f"{'command':32} {'wall median':>12} {'wall min':>9} {'CPU median':>11} {'CPU min':>8}")
        for label, command, status in cases:
            wall, cpu = timed(command, status, args.repeats)
            print(f"{label:32} {statistics.median(wall):12.2f} {min(wall):9.2f} "
                  f"{statistics.median(cpu):11.2f} {min(cpu):8.2f}")


if __name__ == "__main__":
    main()
