"""A plan's kinds of local step, timed in this process: what `fl-lightning sweep --mode estimate` prices the
rounds of its runs with (estimate.py).

A kind is what the cost of one local step depends on: the model, the dataset's images and their
augmentation, the batch size, the algorithm with its switches, the constraint, the compute settings
and the precision (`kind_of`). Not the values of the algorithm's or the local optimizer's numbers
(FedProx's mu, FedSAM's rho, a learning rate: they scale a term and add no pass), and not the split
over clients, their number or their local budget: those decide how many steps a round takes
(estimate.py counts them for every point), not what one costs.

A kind is timed at its first grid point, assembled as `fit` assembles it (`rank_inputs`) into one
rank's loop (`FederatedLoop`) on the device and with the CPU threads of a sweep run:

- a warm-up round of one local step for each timed client: the first call of every code path
  (memory allocation, MOON's previous model, SCAFFOLD's control variates, a constraint's projection);
- the same round again, its clients now holding their state as in a run's later rounds, with
  enough local steps to last about TIMED_SECONDS: its CPU time (every thread of this process: the
  work done, which other programs' load inflates far less than the wall time) and its wall time;
- an evaluation of the global model (the test split, and the held-out samples with a validation
  split), and a checkpoint: their wall seconds, the checkpoint's size and its client-state shards'
  per client.

What a run costs besides its rounds is timed with a real `fit` process of the plan's first point of
each dataset (`time_start_up`), started as a sweep starts its runs, for one round of one local step:
its wall seconds from start to exit less that round, its evaluation and its checkpoint are the
start-up (interpreter, imports, settings, data loading and split, run files) and the end of a run.

The unit of work is a client's step where a rank computes its clients one after another (the loop
path: LOOP_CLIENTS clients are timed, a step costs the same whichever client takes it), and a
group's step where a group of clients steps together (the grouped path, on GPUs and for CTP-FL's
fused clients): there one rank's share of the round is timed, as the size of a group sets what one
of its steps costs.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import re
import resource
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Union

import numpy as np
import torch

from fl_lightning.checkpoint import CLIENT_STATES, checkpoint_dir, numbered_checkpoints
from fl_lightning.clients.run import planned_steps
from fl_lightning.cpu import run_threads
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.resolve import ResolvedPoint, describe_point, fit_parser
from fl_lightning.experiments.runs import RunFolder
from fl_lightning.experiments.sweeps import local
from fl_lightning.experiments.sweeps.local import TAIL_LINES, run_environment
from fl_lightning.experiments.sweeps.machine import Resources
from fl_lightning.federation.setup import rank_inputs
from fl_lightning.fit import fit_config_of
from fl_lightning.run_dir import flatten

TIMED_SECONDS = 2.0
"""Wall seconds of local steps timed per kind, after its warm-up round."""
MAX_TIMED_STEPS = 50
"""The most local steps per client of a timed round: a round of fewer is timed again, up to
MAX_TIMED_ROUNDS times, until TIMED_SECONDS have passed."""
MAX_TIMED_ROUNDS = 100
LOOP_CLIENTS = 2
"""Clients timed on the loop path."""
KIND_GROUPS = ("model", "algorithm", "constraint", "client_optimizer", "compute")
STEP_DATA = ("name", "root", "augment", "crop_padding")
"""The data settings that make a step's inputs (which images, how augmented); the split is not one."""


def kind_of(config: dict) -> str:
    """What the cost of a local step depends on (see the module docstring), as a key."""
    kind = {group: config[group] for group in KIND_GROUPS}
    kind["data"] = {name: config["data"][name] for name in STEP_DATA}
    kind["batch_size"] = config["federation"]["batch_size"]
    kind["precision"] = config["fabric"]["precision"]
    return repr(sorted((name, _switch(name, value)) for name, value in flatten(kind).items()))


def _switch(name: str, value):
    """A number of the algorithm or the local optimizer counts only as zero or not (momentum 0 skips
    the momentum buffer); any other setting as itself (MOON's projection_dim, CONST's switches)."""
    if name.startswith(("algorithm.init_args.", "client_optimizer.")) and isinstance(value, float):
        return "zero" if value == 0 else "nonzero"
    return value


@dataclass
class Stretch:
    """Timed rounds of one kind: the units of work done, and the time it took."""

    units: int = 0
    cpu_seconds: float = 0.0
    """Of every thread of this process."""
    wall_seconds: float = 0.0
    waiting_seconds: float = 0.0
    """Time this process's threads were ready to run but waited for a CPU that other work held
    (Linux's schedstat; 0 where it is not kept)."""


@dataclass
class StepCost:
    """One kind of local step, timed."""

    grouped: bool
    """Timed on the grouped path: the unit is a group's step (else a client's)."""
    stateful: bool
    """The algorithm keeps per-client state (which decides which rank trains a client)."""
    work: Stretch
    """On the CPU, timed on one thread: its CPU time is the work, which other programs' load leaves
    nearly as it is (on several threads, one waiting for another that the load took off its core
    spins, and its CPU time grows with the load). On a GPU, the same as `timed`."""
    timed: Stretch
    """With the threads of a run: its wall time is a round's."""
    peak_bytes: int
    """Of the timed rounds: the GPU's memory, or this process's resident set on the CPU."""
    checkpoint_bytes: int
    """A checkpoint's main file."""
    state_bytes_per_client: float
    """In memory, of a client that holds state."""
    shard_bytes_per_client: float
    """In the checkpoint's client-state shards, of a client that holds state."""
    train_labels: np.ndarray
    """The dataset's training labels, which the split over clients is drawn from."""
    eval_seconds: float = 0.0
    """Wall seconds of one evaluation of the global model (an evaluated round's eval_seconds)."""
    checkpoint_seconds: float = 0.0
    """Wall seconds of writing one checkpoint."""
    grad_evals_per_step: int = 1
    """A client's gradient evaluations per local step (its method's `step_passes` once it has reported)."""
    bytes_per_client: int = 0
    """What one client sends and receives in a round (fl_lightning.federation.costs.ModelSizes), its
    method's rebuilt directions apart."""
    rebuilt_bytes: int = 0
    """The directions a client rebuilds from two consecutive models where it received the previous one
    and the rule makes them the server's step (`Algorithm.rebuilds_from_models`), else receives."""
    rebuilds: bool = False
    """Whether the rule makes them the server's step in this kind's runs."""

    @property
    def cpu_per_unit(self) -> float:
        return self.work.cpu_seconds / self.work.units

    @property
    def wall_per_unit(self) -> float:
        return self.timed.wall_seconds / self.timed.units


def time_kind(entry: ResolvedPoint, machine: Resources, out_dir: Path) -> StepCost:
    """Time the kind of `entry`'s steps here (see the module docstring), with `machine`'s device and threads."""
    from fl_lightning.federation.client_paths import uses_grouped_path
    from fl_lightning.federation.loop import FederatedLoop

    arguments = fit_parser().instantiate(entry.settings).fit
    arguments.pop("config", None)
    checked = fit_config_of(arguments)
    settings = dataclasses.replace(checked.settings, callbacks=[])  # the steps are timed, not what a callback does
    device = torch.device("cuda" if machine.gpu_slots is not None else "cpu")
    algorithm, federation = settings.algorithm, settings.federation
    grouped = uses_grouped_path(settings.compute.client_path, device, algorithm.fuses_clients)
    clients = math.ceil(federation.clients_per_round / machine.devices) if grouped else LOOP_CLIENTS
    timed_federation = dataclasses.replace(federation, clients_per_round=min(clients, federation.clients_per_round))
    callers_threads = torch.get_num_threads()
    try:
        loop = FederatedLoop(_fabric(machine, settings.fabric.precision),
                             rank_inputs(dataclasses.replace(settings, federation=timed_federation), out_dir=out_dir,
                                       run_id="estimate", hyperparameters=checked.config))
        most_steps = max(planned_steps(len(part), federation) for part in loop.inputs.data.partition)
        threads = sweep_run_threads(settings.compute.cpu_threads,
                                    sum(p.numel() for p in loop.module.parameters()), machine)
        return _time_loop(loop, grouped, device, most_steps, federation.rounds, threads)
    finally:
        torch.set_num_threads(callers_threads)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def sweep_run_threads(setting: Union[int, Literal["auto"]], parameters: int, machine: Resources) -> int:
    """A sweep run's torch threads, by the rule `fit` follows (fl_lightning.cpu.run_threads) in the
    process a sweep starts: its environment (`run_environment`) and its CPUs; on GPUs the
    OMP_NUM_THREADS it is given."""
    environment = run_environment(machine, 0)
    choice = run_threads(machine.gpu_slots is None, setting, parameters, 1, environment, cpus=machine.threads)
    return int(environment["OMP_NUM_THREADS"]) if choice is None else choice.threads


SRUN_HINT = "The `srun` command is available on your system but is not used"
"""Lightning's warning wherever an srun binary exists: about a run under SLURM, none of the estimate's."""


def _fabric(machine: Resources, precision: str):
    from lightning.fabric import Fabric

    # One device, the first of the run's first slot (CUDA_VISIBLE_DEVICES is this process's).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SRUN_HINT)
        return Fabric(accelerator=machine.accelerator, devices=1, precision=precision)


def _time_loop(loop, grouped: bool, device: torch.device, most_steps: int, rounds: int, threads: int
               ) -> StepCost:
    _reset_peak_memory(device)
    warm_up = _timed_rounds(loop, 1, threads, once=True).wall_seconds
    steps = max(1, min(MAX_TIMED_STEPS, most_steps, int(TIMED_SECONDS / max(warm_up, 1e-3))))
    timed = _timed_rounds(loop, steps, threads)
    work = _timed_rounds(loop, steps, 1) if device.type == "cpu" and threads > 1 else timed
    evaluation = _wall_seconds(loop.evaluate)
    # Sized as a finished run's checkpoint, whose metrics hold a row a round.
    loop.history = [{**loop.history[-1], "round": number} for number in range(1, rounds + 1)]
    checkpoint_seconds = _wall_seconds(loop.save_checkpoint)
    peak = _peak_memory_bytes(device)
    states = loop.client_states.by_client
    state_bytes = sum(tensor.nelement() * tensor.element_size() for state in states.values()
                      for tensor in state.values())
    checkpoint, shards = _checkpoint_sizes(loop.out_dir)
    holding = max(len(states), 1)
    return StepCost(grouped=grouped, stateful=loop.stateful, work=work, timed=timed, peak_bytes=peak,
                    checkpoint_bytes=checkpoint, state_bytes_per_client=state_bytes / holding,
                    shard_bytes_per_client=shards / holding, train_labels=loop.inputs.data.train.labels.numpy(),
                    eval_seconds=evaluation, checkpoint_seconds=checkpoint_seconds, **_declared_cost(loop))


def _declared_cost(loop) -> dict:
    """What the kind's method declares it costs (`Algorithm.cost`), in the StepCost's terms."""
    sizes, algorithm, federation = loop.costs.sizes, loop.algorithm, loop.inputs.settings.federation
    equal_steps = federation.local_epochs is None and federation.stragglers is None
    return {"grad_evals_per_step": algorithm.step_passes(True).backward,
            "bytes_per_client": sizes.upload + sizes.model + sizes.buffers + sizes.sent_down,
            "rebuilt_bytes": sizes.rebuilt_down,
            "rebuilds": algorithm.rebuilds_from_models(loop.server_state.optimizer, equal_steps)}


def _wall_seconds(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def time_start_up(entry: ResolvedPoint, machine: Resources, out_dir: Path, cost: StepCost) -> float:
    """Wall seconds a run of `entry` takes besides its rounds, evaluations and checkpoints: a real `fit`
    process of it, started as a sweep starts a run (its environment and CPUs), for one round of one
    local step in `out_dir` with W&B off, from its start to its exit, less that round, its evaluation
    and `cost`'s checkpoint."""
    point = dataclasses.replace(entry.point, out_dir=out_dir, overrides={
        **entry.point.overrides, "federation.rounds": 1, "federation.local_steps": 1, "federation.local_epochs": None,
        "logger.wandb_mode": "disabled"})
    out_dir.mkdir(parents=True)
    log = out_dir / "start_up.log"
    with open(log, "wb") as handle:
        started = time.perf_counter()
        # W&B off whatever WANDB_MODE says, which would take logger.wandb_mode's place: no run of W&B's.
        environment = {**run_environment(machine, 0), "WANDB_MODE": "disabled"}
        process = local.start_run_process(local.fit_command(point, machine), environment, handle,
                                          None if machine.cpu_slots is None else machine.cpu_slots[0])
        try:
            status = process.wait()
        finally:
            if process.poll() is None:  # interrupted: the run is in a session of its own
                process.kill()
                process.wait()
        seconds = time.perf_counter() - started
    rows = RunFolder(out_dir).history if status == 0 else []
    if not rows or not isinstance(rows[0].get("round_seconds"), (int, float)):
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-TAIL_LINES:])
        raise ConfigError("estimate", "a point whose fit runs a round",
                          f"[{entry.point.index}] {describe_point(entry.point)} exited {status}:\n{tail}")
    trained = rows[0]["round_seconds"] + (rows[0].get("eval_seconds") or 0.0)
    return max(seconds - trained - cost.checkpoint_seconds, 0.0)


def _timed_rounds(loop, steps: int, threads: int, once: bool = False) -> Stretch:
    """Round 0 (the same clients every time) with `steps` local steps per client on `threads` threads,
    again and again until TIMED_SECONDS have passed (or MAX_TIMED_ROUNDS rounds, or `once`)."""
    trainer = loop.trainer
    federation = dataclasses.replace(trainer.settings.federation, local_steps=steps, local_epochs=None)
    trainer.settings = dataclasses.replace(trainer.settings, federation=federation)
    units = steps if loop.client_path.grouped else steps * loop.inputs.settings.federation.clients_per_round
    torch.set_num_threads(threads)
    # On one thread torch computes in this thread alone: its CPU time leaves out what other threads of
    # the process (a logger's, a process group's) do meanwhile.
    cpu_clock = time.thread_time if threads == 1 else time.process_time
    stretch = Stretch()
    while True:
        cpu, wall, waiting = cpu_clock(), time.perf_counter(), _waiting_seconds()
        loop.run_round(0)  # ends reading the aggregate on the host: the device's work is done
        stretch.units += units
        stretch.cpu_seconds += cpu_clock() - cpu
        stretch.wall_seconds += time.perf_counter() - wall
        stretch.waiting_seconds += _waiting_seconds() - waiting
        if once or stretch.wall_seconds >= TIMED_SECONDS or stretch.units >= MAX_TIMED_ROUNDS * units:
            return stretch


def _waiting_seconds() -> float:
    """How long this process's threads have waited, ready to run, for a CPU (Linux; 0 elsewhere)."""
    waited = 0
    for path in Path("/proc/self/task").glob("*/schedstat"):
        try:
            waited += int(path.read_text().split()[1])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return waited / 1e9


def _checkpoint_sizes(out_dir: Path) -> tuple[int, int]:
    """Bytes of the newest checkpoint's main file and of the client state it wrote: the client-state files
    and index deltas (the loop's first checkpoint writes every state it holds)."""
    newest = numbered_checkpoints(checkpoint_dir(out_dir))[-1]
    client_files = (path for path in (Path(out_dir) / CLIENT_STATES).rglob("*") if path.is_file())
    return newest.stat().st_size, sum(path.stat().st_size for path in client_files)


STATUS_FILE = Path("/proc/self/status")


def _reset_peak_memory(device: torch.device) -> None:
    """Start the peak anew: the GPU's, or on Linux this process's resident high-water mark (elsewhere
    the process's peak so far stays, an upper bound)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        match = re.search(r"^VmHWM:\s+(\d+) kB", STATUS_FILE.read_text(), re.M)
    except OSError:
        match = None
    if match is not None:
        return 1024 * int(match.group(1))
    # Linux reports maxrss in KiB (and has VmHWM); macOS in bytes.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
