"""`fl-lightning sweep PLAN --estimate`: a plan's budget on this machine, before it is run or submitted.

For each distinct (model, data, federation) of the grid (their settings that define the experiment;
the methods, seeds and rounds aside), one point, its first, is trained for real for 2 rounds (1 if
the plan has 1): `fl-lightning fit` with the point's settings, in a temporary folder, with the
devices and threads its sweep run would get (--gpus_per_run, --threads_per_run, --jobs), a
checkpoint after every round, W&B off. Printed per point, and in total over the grid:

- seconds per round: the `round_seconds` the run logs for its last round (its training, without
  evaluation and checkpoints; after the first round's warm-up when it trains two);
- rounds: the point's `federation.rounds`, and device-hours: seconds per round x rounds x devices
  (GPUs, or the run's CPU threads as core-hours), summed over the runs each point stands for;
- peak memory of a run: torch.cuda.max_memory_allocated of its first rank's GPU, on the CPU the
  largest resident set (resource.getrusage's maxrss) of its process and the ranks it started;
- disk for checkpoints: a checkpoint's size x the checkpoints a finished run keeps (the newest
  `checkpoint.keep` of those written every `checkpoint.every` rounds and after the last; last.ckpt
  is a link to the newest), plus its client-state shards, scaled from the clients that hold state after
  the timed rounds to all the clients that will (`num_clients`, or `clients_per_round` x rounds).

The large plans' points take as long to time as two of their rounds; `--override` scales a plan
down (`--override federation.rounds=20`; the figures per round are the same).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fl_lightning.checkpoint import checkpoint_dir, load_checkpoint, numbered_checkpoints
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.local import Resources, _log_tail, fit_command, plan_resources, run_environment
from fl_lightning.experiments.resolve import ResolvedPoint, describe_point
from fl_lightning.experiments.runs import read_metric_rows
from fl_lightning.run_dir import flatten, is_safe_to_change

if TYPE_CHECKING:
    from fl_lightning.experiments.plan import Plan
    from fl_lightning.experiments.sweep import SweepOptions

TIMED_ROUNDS = 2
SHAPE_GROUPS = ("model", "data", "federation")
LOG_FILE = "estimate.log"
REPORT_FILE = "peak_memory.json"


@dataclass
class Estimate:
    """One timed point and the grid points it stands for."""

    point: ResolvedPoint
    runs: list[ResolvedPoint]
    seconds_per_round: float
    device_hours: float
    """Over all its runs, each at its own rounds."""
    peak_bytes: int
    checkpoint_bytes: int
    kept: int
    client_state_bytes: int
    """Of one checkpoint, with every client that will hold state."""

    @property
    def disk_bytes(self) -> int:
        """Checkpoints of one run."""
        return (self.checkpoint_bytes + self.client_state_bytes) * self.kept


def estimate_plan(plan: Plan, resolved: list[ResolvedPoint], options: SweepOptions) -> list[Estimate]:
    """Time one point per distinct (model, data, federation) here and print the plan's budget."""
    jobs = options.jobs or 1
    machine = plan_resources(jobs, options.gpus_per_run, options.threads_per_run)
    devices, unit = ((machine.devices, "GPU") if machine.gpu_slots is not None else (machine.threads, "CPU-core"))
    groups = group_by_shape(resolved)
    print(f"estimate of plan {plan.name} ({len(resolved)} runs): {len(groups)} point(s), one per distinct model, "
          f"data and federation, each trained {TIMED_ROUNDS} round(s) here {machine.describe()}", flush=True)
    estimates = []
    with tempfile.TemporaryDirectory(prefix="fl-lightning-estimate-") as folder:
        for number, entries in enumerate(groups.values()):
            print(f"timing [{entries[0].point.index}] {describe_point(entries[0].point)} ...", flush=True)
            estimates.append(_time_point(entries, machine, devices, Path(folder) / f"point{number}"))
    _print_budget(estimates, unit, machine, jobs)
    return estimates


def group_by_shape(resolved: list[ResolvedPoint]) -> dict[str, list[ResolvedPoint]]:
    """The grid points by what the cost of their rounds depends on, in grid order: each group is timed
    once, at its first point."""
    groups: dict[str, list[ResolvedPoint]] = {}
    for entry in resolved:
        groups.setdefault(_shape(entry.config), []).append(entry)
    return groups


def _shape(config: dict) -> str:
    """What the cost of a round depends on: the model, data and federation settings of the experiment."""
    defining = {name: value for name, value in flatten({group: config[group] for group in SHAPE_GROUPS}).items()
                if not is_safe_to_change(name)}
    return json.dumps(defining, sort_keys=True, default=str)


def _time_point(entries: list[ResolvedPoint], machine: Resources, devices: int, out_dir: Path) -> Estimate:
    entry = entries[0]
    rounds = min(TIMED_ROUNDS, entry.rounds)
    out_dir.mkdir(parents=True)
    report = out_dir / REPORT_FILE
    # The point's own `fit` process (fit_command: python -m fl_lightning fit ...), run under the
    # command that records the process's peak memory after fit returns.
    fit = fit_command(dataclasses.replace(entry.point, out_dir=out_dir), machine)[3:]
    command = [sys.executable, "-m", "fl_lightning.cli.peak_memory", str(report), *fit,
               "--federation.rounds", str(rounds), "--checkpoint.every", "1", "--logger.wandb_mode", "disabled",
               "--resume", "null"]
    log = out_dir.parent / f"{out_dir.name}.{LOG_FILE}"
    with open(log, "wb") as handle:
        status = subprocess.run(command, env=run_environment(machine, 0), stdin=subprocess.DEVNULL, stdout=handle,
                                stderr=subprocess.STDOUT).returncode
    rows, _ = read_metric_rows(out_dir)
    if status != 0 or not rows or not report.is_file():
        lines = "\n".join(f"    | {line}" for line in _log_tail(log, 0))
        raise ConfigError("estimate", "a point that trains", f"[{entry.point.index}] {describe_point(entry.point)} "
                          f"exited with status {status}; the end of its log:\n{lines}")
    seconds = float(rows[-1]["round_seconds"])
    checkpoint, client_state = _checkpoint_sizes(out_dir, entry.config["federation"])
    return Estimate(point=entry, runs=entries, seconds_per_round=seconds,
                    device_hours=sum(seconds * run.rounds * devices for run in entries) / 3600,
                    peak_bytes=json.loads(report.read_text())["peak_bytes"], checkpoint_bytes=checkpoint,
                    kept=_checkpoints_kept(entry.config["checkpoint"], entry.rounds), client_state_bytes=client_state)


def _checkpoints_kept(checkpoint: dict, rounds: int) -> int:
    """The numbered checkpoints a finished run keeps: one every `every` rounds and one after the last,
    the newest `keep` of them."""
    written = set(range(checkpoint["every"], rounds + 1, checkpoint["every"])) | {rounds}
    return min(checkpoint["keep"], len(written))


def _checkpoint_sizes(out_dir: Path, federation: dict) -> tuple[int, int]:
    """Bytes of the newest checkpoint's main file, and of its client-state shards once every client
    that will hold state does."""
    newest = numbered_checkpoints(checkpoint_dir(out_dir))[-1]
    shards = sorted(newest.parent.glob(newest.name.removesuffix(".ckpt") + ".clients_rank*.pt"))
    if not shards:
        return newest.stat().st_size, 0
    holding = len(load_checkpoint(newest)["client_states"])
    eventually = min(federation["num_clients"], federation["clients_per_round"] * federation["rounds"])
    shard_bytes = sum(shard.stat().st_size for shard in shards)
    return newest.stat().st_size, round(shard_bytes / max(holding, 1) * max(eventually, holding))


def _print_budget(estimates: list[Estimate], unit: str, machine: Resources, jobs: int) -> None:
    memory = "GPU memory" if machine.gpu_slots is not None else "memory (maxrss)"
    header = ("point", "runs", "s/round", "rounds", f"{unit} h", f"peak {memory}", "checkpoint", "kept",
              "client state", "disk per run")
    rows = []
    for estimate in estimates:
        rounds = sorted({run.rounds for run in estimate.runs})
        rows.append((f"[{estimate.point.point.index}] {describe_point(estimate.point.point)}", str(len(estimate.runs)),
                     f"{estimate.seconds_per_round:.3g}", "/".join(map(str, rounds)), f"{estimate.device_hours:.3g}",
                     _size(estimate.peak_bytes), _size(estimate.checkpoint_bytes), str(estimate.kept),
                     _size(estimate.client_state_bytes), _size(estimate.disk_bytes)))
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    runs = sum(len(estimate.runs) for estimate in estimates)
    hours = sum(estimate.device_hours for estimate in estimates)
    disk = sum(estimate.disk_bytes * len(estimate.runs) for estimate in estimates)
    peak = max(estimate.peak_bytes for estimate in estimates)
    print(f"total: {runs} runs, {hours:.3g} {unit} hours, {_size(disk)} of checkpoints, peak {memory} "
          f"{_size(peak)} per run ({jobs} at a time)", flush=True)


def _size(count: float) -> str:
    if count < 1024:
        return f"{count:.0f} B"
    for unit in ("KiB", "MiB"):
        count /= 1024
        if count < 1024:
            return f"{count:.1f} {unit}"
    return f"{count / 1024:.1f} GiB"
