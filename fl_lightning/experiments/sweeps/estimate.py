"""`fl-lightning sweep PLAN --mode estimate`: a plan's budget on this machine, before it is run or submitted.

Every kind of local step of the grid (step_costs.py: the model, data, batch size, method and precision
a step's cost depends on) is timed once, here, in this process, with the device and threads a sweep
run would get (--gpus_per_run, --threads_per_run, --jobs): a warm-up round, then about
step_costs.TIMED_SECONDS of local steps. Every grid point is then priced from its kind's cost per
step and its own rounds' work: the local steps of the clients it samples (its split, federation and
local budget), averaged over its first SAMPLED_ROUNDS rounds, for one rank of the run (a run of G
GPUs deals its clients to G ranks). A plan's tuning runs are priced as its others (the runs of a
tuned method whose choice is not made yet at its first candidate). Printed, one line per method of
the plan (and per tuned method, `FedAvg (tuning)`) and in total:

- seconds per round, wall and CPU (the CPU time of the timed steps: the work, which a busy
  machine inflates far less than the wall time; a line says how busy the machine was while timing);
- wall seconds per run: its start-up (a real `fit` process of the plan's first point of each
  dataset, timed here: step_costs.time_start_up), its rounds, its evaluations (one timed per kind,
  x the rounds it evaluates: every `federation.eval_every` and the last) and its checkpoints (one
  timed per kind, x those it writes); the total wall time is the runs', `--jobs` at a time;
- rounds, CPU core-hours (CPU seconds x rounds, over the runs) and, on GPUs, GPU-hours (wall
  seconds x rounds x GPUs);
- gradient evaluations and bytes sent and received per run, from each method's declared cost
  (`Algorithm.cost`, as the runs' cost counters count them): its clients' sampled local steps x its
  gradient evaluations per step (MOON's contrastive steps, which a client's first round has not), and
  its clients per round x what a client sends and receives (a direction the clients rebuild from two
  consecutive models priced as sent unless every client takes part in every round) x rounds;
- peak memory of a run while it trains (the GPU's, or the process's resident set on the CPU) and the
  memory of the client state of a stateful method (SCAFFOLD, FedDyn, MOON) once every client that will
  hold state does (`num_clients`, or `clients_per_round` x rounds), on the CPU of its owner ranks;
- disk for checkpoints: a checkpoint's size with the client-state shards of those clients x the
  checkpoints a finished run keeps (the newest `checkpoint.keep` of those written every
  `checkpoint.every` rounds and after the last; last.ckpt is a link to the newest).

A round's figures are its training alone, as a run's `round_seconds`; a run's and the total wall
time add what a run costs besides. The estimate says how long it will take before it starts (about
KIND_OVERHEAD_SECONDS + TIMED_SECONDS a kind, and a `fit` start a dataset); Ctrl-C stops it and
prints the points priced so far.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fl_lightning.clients.run import planned_steps
from fl_lightning.config import ComputeArgs, DataArgs, FederationArgs
from fl_lightning.cpu import available_cores
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import Plan
from fl_lightning.experiments.plans.resolve import ResolvedPoint, describe_point
from fl_lightning.experiments.plans.tune_grid import describe_candidate
from fl_lightning.experiments.sweeps import step_costs
from fl_lightning.experiments.sweeps.local import note_unused_gpus
from fl_lightning.experiments.sweeps.machine import Resources, SweepOptions, plan_resources
from fl_lightning.experiments.sweeps.step_costs import (
    StepCost,
    Stretch,
    kind_of,
    time_kind,
    time_start_up,
)

SAMPLED_ROUNDS = 100
"""Rounds whose clients are drawn to count a point's local steps per round."""
KIND_OVERHEAD_SECONDS = 1.5
"""What a kind costs besides its timed steps (its data, model, warm-up round, checkpoint), roughly."""
BUSY_WAITING = 0.1
"""The machine was busy when the timed steps, ready to run, waited this share of the time for a CPU."""


@dataclass
class PricedPoint:
    """A grid point priced from its kind's timing."""

    entry: ResolvedPoint
    cost: StepCost
    units_per_round: float
    """One rank's work in a round, in the kind's units (client steps, or group steps)."""
    ranks: int
    holding: int
    """The clients that will hold state (of a stateful method): num_clients, or clients_per_round x rounds."""
    kept: int
    start_up: float = 0.0
    """Wall seconds of the run besides its rounds, evaluations and checkpoints (its dataset's, timed)."""
    evaluations: int = 0
    """Rounds it evaluates the global model after."""
    checkpoints: int = 0
    """Checkpoints it writes."""
    grad_evals_per_round: float = 0.0
    """Its clients' gradient evaluations in a round, all ranks' (its method's declared cost)."""
    bytes_per_round: float = 0.0
    """What its clients send and receive in a round (its method's declared cost)."""
    client_state_bound: Optional[int] = None
    """The most client state the run keeps in memory: compute.client_state_memory_mib x its ranks."""

    @property
    def rounds(self) -> int:
        return self.entry.rounds

    @property
    def cpu_per_round(self) -> float:
        return self.cost.cpu_per_unit * self.units_per_round * self.ranks

    @property
    def wall_per_round(self) -> float:
        return self.cost.wall_per_unit * self.units_per_round

    @property
    def run_seconds(self) -> float:
        """The run's wall seconds from its process's start to its exit."""
        return (self.start_up + self.rounds * self.wall_per_round + self.evaluations * self.cost.eval_seconds
                + self.checkpoints * self.cost.checkpoint_seconds)

    @property
    def client_state_bytes(self) -> int:
        """In memory, once every client that will hold state does, up to the run's bound."""
        held = round(self.cost.state_bytes_per_client * self.holding)
        return held if self.client_state_bound is None else min(held, self.client_state_bound)

    @property
    def client_store_bytes(self) -> int:
        """On disk in the run's client_states/: a file of every client that will hold state."""
        return round(self.cost.shard_bytes_per_client * self.holding)

    @property
    def checkpoint_bytes(self) -> int:
        """One checkpoint, with the shards of every client that will hold state."""
        return round(self.cost.checkpoint_bytes + self.cost.shard_bytes_per_client * self.holding)

    @property
    def disk_bytes(self) -> int:
        return self.checkpoint_bytes * self.kept


def estimate_plan(plan: Plan, resolved: list[ResolvedPoint], options: SweepOptions) -> list[PricedPoint]:
    """Time every kind of local step of the grid here and print the plan's budget (Ctrl-C: what is priced)."""
    jobs = options.jobs or 1
    machine = plan_resources(jobs, options.gpus_per_run, options.threads_per_run)
    kinds = group_by_kind(resolved)
    if machine.gpu_slots is None:
        note_unused_gpus()
    _announce(plan, resolved, len(kinds), machine)
    load, started = os.getloadavg()[0], time.perf_counter()
    costs: dict[str, StepCost] = {}
    start_ups: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="fl-lightning-estimate-") as folder:
            for number, (kind, entries) in enumerate(kinds.items()):
                cost = _time(entries[0], machine, Path(folder) / f"kind{number}")
                if dataset_of(entries[0]) not in start_ups:
                    start_ups[dataset_of(entries[0])] = _time_start_up(entries[0], machine,
                                                                       Path(folder) / f"start{number}", cost)
                costs[kind] = cost
    except KeyboardInterrupt:
        untimed = sorted({e.point.method for k, entries in kinds.items() if k not in costs for e in entries})
        print(f"interrupted: {len(costs)} of {len(kinds)} kind(s) timed; not priced: {', '.join(untimed)}",
              file=sys.stderr, flush=True)
        _report(resolved, costs, start_ups, machine, jobs, load, started)
        raise SystemExit(130) from None
    return _report(resolved, costs, start_ups, machine, jobs, load, started)


def _announce(plan: Plan, resolved: list[ResolvedPoint], kinds: int, machine: Resources) -> None:
    """What will be timed, and about how long it will take."""
    stretches = 2 if machine.gpu_slots is None and machine.threads > 1 else 1
    seconds = kinds * (KIND_OVERHEAD_SECONDS + stretches * step_costs.TIMED_SECONDS)
    also = ", then as long on one thread where its runs take more" if stretches == 2 else ""
    datasets = len({dataset_of(entry) for entry in resolved})
    print(f"estimate of plan {plan.name} ({len(resolved)} runs, {len({e.point.method for e in resolved})} "
          f"method(s)): {kinds} kind(s) of local step to time here {machine.describe()}, at most about "
          f"{seconds:.0f} s (each: a warm-up round of one step per client, then up to "
          f"{step_costs.TIMED_SECONDS:g} s of steps{also}), and the start-up of a run of {datasets} dataset(s): "
          "a `fit` process each, for one round", flush=True)
    waiting = {entry.point.method: entry.point.tuned for entry in resolved if entry.point.waiting}
    if waiting:
        print("note: runs whose tuning choice is not made yet are priced at their method's first candidate: "
              + ", ".join(f"{method} at {describe_candidate(tuned)}" for method, tuned in waiting.items()), flush=True)


def group_by_kind(resolved: list[ResolvedPoint]) -> dict[str, list[ResolvedPoint]]:
    """The grid points by what a local step of theirs costs, in grid order: each kind is timed once,
    at its first point."""
    kinds: dict[str, list[ResolvedPoint]] = {}
    for entry in resolved:
        kinds.setdefault(kind_of(entry.config), []).append(entry)
    return kinds


def dataset_of(entry: ResolvedPoint) -> str:
    """What a run's start-up depends on besides the imports: the dataset it loads and splits."""
    data = entry.config["data"]
    return f"{data['name']} in {data['root']}"


def _time_start_up(entry: ResolvedPoint, machine: Resources, out_dir: Path, cost: StepCost) -> float:
    seconds = time_start_up(entry, machine, out_dir, cost)
    print(f"timed the start-up of a run of {dataset_of(entry)} ([{entry.point.index}], a `fit` process to its exit, "
          f"less its round, evaluation and checkpoint): {seconds:.3g} s", flush=True)
    return seconds


def _time(entry: ResolvedPoint, machine: Resources, out_dir: Path) -> StepCost:
    point = entry.point
    try:
        cost = time_kind(entry, machine, out_dir)
    except ConfigError as err:
        raise ConfigError("estimate", "a point that trains", f"[{point.index}] {describe_point(point)}: {err}") from err
    unit = "group" if cost.grouped else "client"
    print(f"timed [{point.index}] {describe_point(point)}: {cost.timed.units} {unit} step(s) in "
          f"{cost.timed.wall_seconds:.3g} s; on one thread {cost.work.units} in {cost.work.cpu_seconds:.3g} CPU s",
          flush=True)
    return cost


def _report(resolved: list[ResolvedPoint], costs: dict[str, StepCost], start_ups: dict[str, float],
            machine: Resources, jobs: int, load: float, started: float) -> list[PricedPoint]:
    priced = _price(resolved, costs, start_ups, machine)
    if priced:
        _print_budget(priced, machine, jobs)
    if costs:  # interrupted before a kind was timed, there is nothing to say of the timing
        _print_machine(costs, load, time.perf_counter() - started)
    return priced


def _price(resolved: list[ResolvedPoint], costs: dict[str, StepCost], start_ups: dict[str, float],
           machine: Resources) -> list[PricedPoint]:
    units: dict[str, tuple[float, float]] = {}
    priced = []
    for entry in resolved:
        cost = costs.get(kind_of(entry.config))
        if cost is None:
            continue
        config = entry.config
        federation = FederationArgs(**config["federation"])
        key = json.dumps([config["data"], config["federation"], config["seed"], cost.grouped, cost.stateful],
                         sort_keys=True, default=str)
        if key not in units:
            units[key] = units_per_round(cost, DataArgs(**config["data"]), federation, config["seed"], machine.devices)
        holding = min(federation.num_clients, federation.clients_per_round * federation.rounds)
        priced.append(PricedPoint(entry=entry, cost=cost, units_per_round=units[key][0], ranks=machine.devices,
                                  grad_evals_per_round=units[key][1] * cost.grad_evals_per_step,
                                  bytes_per_round=bytes_per_round(cost, federation),
                                  holding=holding, kept=_checkpoints_kept(config["checkpoint"], entry.rounds),
                                  start_up=start_ups[dataset_of(entry)],
                                  evaluations=evaluated_rounds(federation.eval_every, entry.rounds),
                                  checkpoints=len(_checkpoints_written(config["checkpoint"], entry.rounds)),
                                  client_state_bound=_client_state_bound(config, machine.devices)))
    return priced


def evaluated_rounds(every: int, rounds: int) -> int:
    """The rounds a run evaluates the global model after: every `every`-th and the last."""
    return rounds // every + (rounds % every != 0)


def units_per_round(cost: StepCost, data: DataArgs, federation: FederationArgs, seed: int, ranks: int
                    ) -> tuple[float, float]:
    """One rank's work in a round of a point, in its kind's units, over the point's first rounds: the
    local steps of the rank's clients on the loop path, its longest client's on the grouped path
    (where a group steps as long as its longest client); and the local steps of all its clients."""
    from fl_lightning.federation.aggregation import clients_of_rank, sample_clients
    from fl_lightning.federation.setup import split_over_clients

    partition, _ = split_over_clients(cost.train_labels, data, federation.num_clients, seed)
    steps = [planned_steps(len(part), federation) for part in partition]
    rounds = range(min(federation.rounds, SAMPLED_ROUNDS))
    work = all_steps = 0
    for round_index in rounds:
        clients = sample_clients(seed, round_index, federation.num_clients, federation.clients_per_round)
        taken = [steps[client] for client in clients_of_rank(clients, 0, ranks, cost.stateful)]
        work += max(taken, default=0) if cost.grouped else sum(taken)
        all_steps += sum(steps[client] for client in clients)
    return work / len(rounds), all_steps / len(rounds)


def bytes_per_round(cost: StepCost, federation: FederationArgs) -> float:
    """What a point's clients send and receive in a round, by its method's declared cost: a direction the
    clients may rebuild from two consecutive models is free only when every client takes part in every
    round (else most clients missed the previous one), and priced as sent otherwise."""
    everyone = federation.clients_per_round >= federation.num_clients and federation.participation is None
    rebuilt = 0 if cost.rebuilds and everyone else cost.rebuilt_bytes
    return federation.clients_per_round * (cost.bytes_per_client + rebuilt)


def _checkpoints_written(checkpoint: dict, rounds: int) -> set[int]:
    """The rounds a run writes a checkpoint after: every `every`-th and the last."""
    return set(range(checkpoint["every"], rounds + 1, checkpoint["every"])) | {rounds}


def _checkpoints_kept(checkpoint: dict, rounds: int) -> int:
    """The numbered checkpoints a finished run keeps: the newest `keep` of those it writes."""
    return min(checkpoint["keep"], len(_checkpoints_written(checkpoint, rounds)))


def _print_budget(priced: list[PricedPoint], machine: Resources, jobs: int) -> None:
    on_gpus = machine.gpu_slots is not None
    memory = "GPU memory" if on_gpus else "memory"
    header = ("method", "runs", "s/round", "CPU s/round", "rounds", "s/run", "grad evals/run", "bytes/run",
              "CPU core-h",
              *(("GPU h",) if on_gpus else ()), f"peak {memory}", "client state", "checkpoint", "kept", "disk per run")
    by_method: dict[str, list[PricedPoint]] = {}
    for point in priced:
        grid_point = point.entry.point
        by_method.setdefault(f"{grid_point.method} (tuning)" if grid_point.tuning else grid_point.method,
                             []).append(point)
    rows = [_method_row(method, points, on_gpus) for method, points in by_method.items()]
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    _print_total(priced, machine, jobs)


def _client_state_bound(config: dict, ranks: int) -> int:
    mib = config.get("compute", {}).get("client_state_memory_mib", ComputeArgs.client_state_memory_mib)
    return mib * 2**20 * ranks


def _client_store_line(priced: list[PricedPoint]) -> str:
    """The store of client state, where a stateful method's runs have one; else nothing."""
    stored = [point for point in priced if point.client_store_bytes]
    if not stored:
        return ""
    bound = max(stored, key=lambda point: point.client_store_bytes)
    return (f"; client state: up to {_size(bound.client_store_bytes)} per run on disk (client_states/, one file a "
            f"client), at most {_size(bound.client_state_bound)} of it in memory (compute.client_state_memory_mib "
            f"x {bound.ranks} rank(s))")


def _print_total(priced: list[PricedPoint], machine: Resources, jobs: int) -> None:
    cpu_hours = sum(_hours(point, point.cpu_per_round) for point in priced)
    wall_hours = sum(point.run_seconds for point in priced) / 3600
    disk = sum(point.disk_bytes for point in priced)
    if machine.gpu_slots is not None:  # the client state is kept in the host's memory
        devices = f", {sum(_hours(p, p.wall_per_round) for p in priced) * machine.devices:.3g} GPU hours"
        memory = (f"peak GPU memory {_size(max(point.cost.peak_bytes for point in priced))} per run, and up to "
                  f"{_size(max(point.client_state_bytes for point in priced))} of client state in host memory")
    else:
        devices = ""
        memory = (f"peak memory {_size(max(p.cost.peak_bytes + p.client_state_bytes for p in priced))} per run "
                  "with its client state")
    print(f"total: {len(priced)} runs, {cpu_hours:.3g} CPU core-hours{devices}, {wall_hours / jobs:.3g} h of wall "
          f"time ({jobs} at a time), {_size(disk)} of checkpoints, {memory}{_client_store_line(priced)}", flush=True)
    print(_besides_rounds(priced), flush=True)


def _besides_rounds(priced: list[PricedPoint]) -> str:
    """What the runs' wall time holds besides their rounds (the CPU and GPU hours are the rounds')."""
    terms = [("start-up", [p.start_up for p in priced], len(priced), "runs"),
             ("evaluation", [p.cost.eval_seconds for p in priced], sum(p.evaluations for p in priced),
              "evaluations"),
             ("checkpoint", [p.cost.checkpoint_seconds for p in priced], sum(p.checkpoints for p in priced),
              "checkpoints")]
    hours = {"start-up": sum(p.start_up for p in priced) / 3600,
             "evaluation": sum(p.evaluations * p.cost.eval_seconds for p in priced) / 3600,
             "checkpoint": sum(p.checkpoints * p.cost.checkpoint_seconds for p in priced) / 3600}
    return "of the runs' wall time, besides their rounds: " + "; ".join(
        f"{name} {_spread(seconds)} s x {count} {what}, {hours[name]:.3g} h" for name, seconds, count, what in terms)


def _method_row(method: str, points: list[PricedPoint], on_gpus: bool) -> tuple[str, ...]:
    gpu_hours = sum(_hours(point, point.wall_per_round * point.ranks) for point in points)
    return (method, str(len(points)), _spread([p.wall_per_round for p in points]),
            _spread([p.cpu_per_round for p in points]), "/".join(map(str, sorted({p.rounds for p in points}))),
            _spread([p.run_seconds for p in points]), _spread([p.grad_evals_per_round * p.rounds for p in points]),
            _size_spread([p.bytes_per_round * p.rounds for p in points]),
            f"{sum(_hours(point, point.cpu_per_round) for point in points):.3g}",
            *((f"{gpu_hours:.3g}",) if on_gpus else ()),
            _size(max(p.cost.peak_bytes for p in points)), _size(max(p.client_state_bytes for p in points)),
            _size(max(p.checkpoint_bytes for p in points)), "/".join(map(str, sorted({p.kept for p in points}))),
            _size(max(p.disk_bytes for p in points)))


def _hours(point: PricedPoint, seconds_per_round: float) -> float:
    return seconds_per_round * point.rounds / 3600


def _spread(values: list[float]) -> str:
    """`3.58`, or `3.58-7.21` for the range of a method's settings."""
    low, high = f"{min(values):.3g}", f"{max(values):.3g}"
    return low if low == high else f"{low}-{high}"


def _print_machine(costs: dict[str, StepCost], load_before: float, seconds: float) -> None:
    stretches = [stretch for cost in costs.values() for stretch in {id(s): s for s in (cost.work, cost.timed)}.values()]
    note = machine_note(stretches, load_before, os.getloadavg()[0], available_cores())
    print(f"timed in {seconds:.0f} s; {note}", flush=True)


def machine_note(stretches: list[Stretch], load_before: float, load_after: float, cores: int) -> str:
    """How busy the machine was while timing: how long the timed steps waited for a CPU that other
    work held, and the load average against the cores."""
    waiting = sum(stretch.waiting_seconds for stretch in stretches)
    running = sum(stretch.cpu_seconds for stretch in stretches)
    waited = waiting / (waiting + running) if waiting + running > 0 else 0.0
    busy = waited > BUSY_WAITING or max(load_before, load_after) > cores + 0.5
    verdict = ("busy: other work inflated the wall seconds (the CPU seconds on one thread far less); time it again "
               "on a quiet machine for a round's wall seconds") if busy else "not busy"
    return (f"the timed steps waited for a CPU {waited:.0%} of the time they were ready to run; load average "
            f"{load_before:.1f} before, {load_after:.1f} after, on {cores} core(s): {verdict}")


def _size_spread(counts: list[float]) -> str:
    low, high = _size(min(counts)), _size(max(counts))
    return low if low == high else f"{low}-{high}"


def _size(count: float) -> str:
    if count < 1024:
        return f"{count:.0f} B"
    for unit in ("KiB", "MiB"):
        count /= 1024
        if count < 1024:
            return f"{count:.1f} {unit}"
    return f"{count / 1024:.1f} GiB"
