"""What a plan's grid costs before anything trains, in one process (the parsers built first, as
`fl-lightning` builds them once): parsing a `fit` command line by its command's parser, as
`parse_command_line` does, against the whole parser of every command (the reference, in the same
run); resolving every point of a plan, as `sweep` does before it runs one; and `table` of the plan
with no runs, which resolves none.

    .venv/bin/python benchmarks/resolve.py [--plan configs/plans/ctpfl_table1.yaml] [--repeats 20]

CPU seconds of this process (time.process_time), from the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path

from fl_lightning.cli.arguments import expand_bare_flags, expand_short_names
from fl_lightning.cli.parser import parse_command_line
from fl_lightning.commands.main import command_parser
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.plans.resolve import fit_parser, resolve_grid
from fl_lightning.experiments.results.table import table

FIT_LINE = ["fit", "--config", "configs/quickstart.yaml", "--algorithm", "fedprox", "--federation.rounds", "3"]


def cpu_seconds(call, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    options = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_argument("--plan", default="configs/plans/ctpfl_table1.yaml")
    options.add_argument("--repeats", type=int, default=20)
    args = options.parse_args(argv)
    parser = command_parser()
    fit_parser()  # built before the resolve is timed, as by a sweep's first point
    expanded = expand_bare_flags(expand_short_names(FIT_LINE), parser.commands)
    parse_command_line(FIT_LINE, parser)  # warm-up: the classes' signatures read once
    by_command = cpu_seconds(lambda: parse_command_line(FIT_LINE, parser), args.repeats)
    whole = cpu_seconds(lambda: parser.parse_args(expanded), args.repeats)
    print(f"parse of `{' '.join(FIT_LINE)}` (median of {args.repeats}): "
          f"{1000 * statistics.median(by_command):.0f} ms by its command's parser, "
          f"{1000 * statistics.median(whole):.0f} ms by the whole parser")
    grid = load_plan(args.plan).grid()
    (resolving,) = cpu_seconds(lambda: resolve_grid(grid), 1)
    print(f"resolving the {len(grid)} points of {args.plan}: {resolving:.2f} CPU s")
    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):
        (tabulating,) = cpu_seconds(lambda: table(plan=args.plan, runs_root=Path(folder) / "runs",
                                                  out=Path(folder) / "table"), 1)
    print(f"table of {args.plan} without runs: {tabulating:.2f} CPU s")


if __name__ == "__main__":
    main()
