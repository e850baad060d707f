"""Seconds per round of FedAvg with LeNet-5 on real CIFAR-10 on the CPU, side by side in one run:
a plain PyTorch client-by-client loop (the reference) against fl-lightning on one rank (client path
`loop` and `grouped`) and on two CPU ranks of one thread each.

Workloads (as `fl-lightning fit` sets them up: Dirichlet(0.5) split with at least 10 samples per
client, seed 0, no augmentation, client SGD lr 0.01 momentum 0.9, FedAvg weighted by samples):

    W1: N=100 clients, S=10 sampled per round, K=50 local steps, B=50
    W2: N=1000 clients, S=50 sampled per round, K=5 local steps, B=10

Methods:

    (a) plain loop: one nn.Module; per client the global state loaded into it, a fresh
        torch.optim.SGD with momentum, K steps over the client's own batches, then the weighted
        average of the clients' state_dicts. The same clients (fl-lightning's sampling) and the same
        batches per client (fl-lightning's seeded batch order) as fl-lightning.
    (b) fl-lightning, one rank, `compute.client_path: loop`, in-process: `FederatedLoop.run_round`
        timed as benchmarks/throughput.py times it.
    (c) the same with `compute.client_path: grouped`.
    (d) `fl-lightning fit --fabric.devices 2` as a subprocess (two CPU ranks, OMP_NUM_THREADS=1 each,
        client_path loop); its `round_seconds` read from the run's metrics.jsonl.

(a), (b) and (c) run in this process with the same torch threads, after one warm-up round each,
taking turns within every repeat so that a slowdown of a shared machine hits all of them alike.
(d) is one run of 1 + repeats rounds per workload, launched right after that workload's in-process
rounds; the median over its rounds after the first is reported. After the warm-up round the plain
loop's global model is compared with fl-lightning's (the same round, up to float rounding).

    python benchmarks/cpu_rounds.py
    python benchmarks/cpu_rounds.py --workloads W1 --repeats 5 --json cpu_rounds.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from fl_lightning.algorithms import FedAvg
from fl_lightning.clients.run import CLIENT_STREAM, batch_positions, seeded_generator
from fl_lightning.config import ClientOptimizerArgs, ComputeArgs, DataArgs, FederationArgs, ModelArgs
from fl_lightning.data import ImageDataset, load_dataset, partition_indices
from fl_lightning.federation.aggregation import aggregation_weights, sample_clients
from fl_lightning.federation.loop import FederatedLoop
from fl_lightning.federation.setup import RunData, RunSettings, initial_network, rank_inputs
from fl_lightning.server_optimizers import ServerSGD

REPOSITORY = Path(__file__).resolve().parents[1]
MODEL = "lenet5"
LR, MOMENTUM = 0.01, 0.9
# fit's defaults for the split (DataArgs) and the seed.
ALPHA, MIN_SAMPLES, SEED = 0.5, 10, 0
RANKS = 2

PLAIN = "(a) plain PyTorch loop"
LOOP = "(b) fl-lightning loop"
GROUPED = "(c) fl-lightning grouped"
TWO_RANKS = "(d) fl-lightning 2 ranks"


@dataclass(frozen=True)
class Workload:
    name: str
    num_clients: int
    clients_per_round: int
    local_steps: int
    batch_size: int

    def describe(self) -> str:
        return (f"{self.name}: N={self.num_clients}, S={self.clients_per_round}, K={self.local_steps}, "
                f"B={self.batch_size}")


WORKLOADS = {w.name: w for w in (Workload("W1", 100, 10, 50, 50), Workload("W2", 1000, 50, 5, 10))}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds per method after one warm-up round; the median is reported (default: 3)")
    parser.add_argument("--data-root", type=Path, default=REPOSITORY / "data",
                        help="folder holding cifar-10-batches-py (default: the repository's data/)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the in-process methods (a)-(c) (default: torch's choice)")
    parser.add_argument("--no-ranks", action="store_true", help="skip (d), the two-rank subprocess run")
    parser.add_argument("--json", type=Path, default=None, help="write the settings and every figure to this file")
    return parser.parse_args(argv)


def normaliser(dataset: ImageDataset):
    """uint8 images -> (x / 255 - mean) / std, plain PyTorch (what fl-lightning's transform computes
    without augmentation)."""
    mean = torch.tensor(dataset.mean).view(1, -1, 1, 1)
    std = torch.tensor(dataset.std).view(1, -1, 1, 1)
    return lambda images: (images.float() / 255 - mean) / std


class PlainLoop:
    """(a): FedAvg client by client in plain PyTorch, one module reused for every client."""

    name = PLAIN

    def __init__(self, network: nn.Module, train: ImageDataset, partition: list, workload: Workload):
        self.model = copy.deepcopy(network)
        self.global_state = {name: tensor.clone() for name, tensor in self.model.state_dict().items()}
        self.images, self.labels = train.images, train.labels
        self.normalise = normaliser(train)
        self.indices = [torch.as_tensor(part, dtype=torch.long) for part in partition]
        self.sizes = [len(part) for part in partition]
        self.workload = workload

    def run_round(self, round_index: int) -> None:
        w = self.workload
        clients = sample_clients(SEED, round_index, w.num_clients, w.clients_per_round)
        weights = aggregation_weights(clients, self.sizes, "num_samples")  # FedAvg's default weighting
        averaged = {name: torch.zeros_like(tensor) for name, tensor in self.global_state.items()
                    if tensor.is_floating_point()}
        model = self.model
        model.train()
        for client in clients:
            model.load_state_dict(self.global_state)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            indices = self.indices[client]
            generator = seeded_generator(SEED, CLIENT_STREAM, round_index, client)
            for positions in batch_positions(len(indices), w.batch_size, w.local_steps, None, generator):
                batch = indices[positions]
                loss = F.cross_entropy(model(self.normalise(self.images[batch])), self.labels[batch])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            for name, tensor in model.state_dict().items():
                if name in averaged:
                    averaged[name].add_(tensor, alpha=weights[client])
        self.global_state.update(averaged)

    def parameters(self) -> dict[str, torch.Tensor]:
        return self.global_state


class InProcess:
    """(b) and (c): a `FederatedLoop` set up as `federation.train()` sets it up on one rank, its run
    assembled as `fit` assembles it from the settings of `fit_command`."""

    def __init__(self, name: str, client_path: str, fabric: Fabric, train: ImageDataset, test: ImageDataset,
                 partition: list, workload: Workload):
        self.name = name
        settings = RunSettings(
            algorithm=FedAvg(), model=ModelArgs(name=MODEL),
            data=DataArgs(alpha=ALPHA, min_samples=MIN_SAMPLES, augment=False),
            federation=FederationArgs(rounds=10**6, num_clients=workload.num_clients,
                                      clients_per_round=workload.clients_per_round,
                                      local_steps=workload.local_steps, batch_size=workload.batch_size),
            client_optimizer=ClientOptimizerArgs(lr=LR, momentum=MOMENTUM), server_optimizer=ServerSGD(lr=1.0),
            compute=ComputeArgs(client_path=client_path), seed=SEED,
        )
        run = rank_inputs(settings, out_dir=Path("benchmark-run"), run_id="benchmark", hyperparameters={},
                        data=RunData(train, test, partition))
        self.loop = FederatedLoop(fabric, run)

    def run_round(self, round_index: int) -> None:
        self.loop.run_round(round_index)

    def parameters(self) -> dict[str, torch.Tensor]:
        return self.loop.module.network.state_dict()


def timed(method, round_index: int) -> float:
    started = time.perf_counter()
    method.run_round(round_index)
    return time.perf_counter() - started


def largest_difference(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    return max((reference[name] - other[name]).abs().max().item() for name in reference)


def fit_command(workload: Workload, rounds: int, data_root: Path, out_dir: Path) -> list[str]:
    executable = Path(sys.executable).with_name("fl-lightning")
    return [
        str(executable), "fit", "--algorithm", "fedavg", "--model.name", MODEL,
        "--data.name", "cifar10", "--data.root", str(data_root), "--data.alpha", str(ALPHA),
        "--data.min_samples", str(MIN_SAMPLES), "--data.augment", "false",
        "--federation.rounds", str(rounds), "--federation.num_clients", str(workload.num_clients),
        "--federation.clients_per_round", str(workload.clients_per_round),
        "--federation.local_steps", str(workload.local_steps), "--federation.batch_size", str(workload.batch_size),
        "--federation.eval_every", str(10**6), "--client_optimizer.lr", str(LR),
        "--client_optimizer.momentum", str(MOMENTUM), "--fabric.accelerator", "cpu",
        "--fabric.devices", str(RANKS), "--compute.client_path", "loop", "--logger.progress_bar", "false",
        "--checkpoint.every", str(10**6), "--seed", str(SEED), "--out_dir", str(out_dir), "--resume", "null",
    ]


def two_ranks(workload: Workload, rounds: int, data_root: Path) -> tuple[list[float], float, list[str]]:
    """(d): the round seconds of a `fl-lightning fit` run on two CPU ranks of one thread each, the
    run's wall time (start-up, data loading and the final evaluation included), and its command."""
    with tempfile.TemporaryDirectory(prefix="cpu_rounds_") as folder:
        out_dir = Path(folder) / "run"
        command = fit_command(workload, rounds, data_root, out_dir)
        environment = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.perf_counter()
        finished = subprocess.run(command, env=environment, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if finished.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({finished.returncode}):\n{finished.stderr[-4000:]}")
        rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["round_seconds"] for row in sorted(rows, key=lambda row: row["round"])], wall, command


def run_workload(workload: Workload, args: argparse.Namespace, fabric: Fabric, train: ImageDataset,
                 test: ImageDataset) -> dict:
    partition = partition_indices(train.labels.numpy(), workload.num_clients, "dirichlet", alpha=ALPHA,
                                  min_samples=MIN_SAMPLES, seed=SEED)
    network = initial_network(ModelArgs(name=MODEL), train, SEED)  # the model InProcess starts from
    methods = [PlainLoop(network, train, partition, workload),
               InProcess(LOOP, "loop", fabric, train, test, partition, workload),
               InProcess(GROUPED, "grouped", fabric, train, test, partition, workload)]
    threads = torch.get_num_threads()
    seconds: dict[str, list[float]] = {method.name: [] for method in methods}
    for method in methods:  # warm-up round
        timed(method, 0)
    # The same first round from the same start: how far fl-lightning's model is from the plain loop's.
    differences = {method.name: largest_difference(methods[0].parameters(), method.parameters())
                   for method in methods[1:]}
    for repeat in range(args.repeats):
        for method in methods:
            seconds[method.name].append(timed(method, repeat + 1))
    rows = [{"method": method.name, "timed": "in-process, run_round", "ranks": 1, "threads_per_rank": threads,
             "round_seconds": seconds[method.name]} for method in methods]
    wall = command = None
    if not args.no_ranks:
        round_seconds, wall, command = two_ranks(workload, 1 + args.repeats, args.data_root)
        rows.append({"method": TWO_RANKS, "timed": "fl-lightning fit subprocess, metrics.jsonl round_seconds",
                     "ranks": RANKS, "threads_per_rank": 1, "round_seconds": round_seconds[1:],
                     "first_round_seconds": round_seconds[0]})
    plain = statistics.median(rows[0]["round_seconds"])
    for row in rows:
        row["median_seconds"] = statistics.median(row["round_seconds"])
        row["vs_plain_loop"] = row["median_seconds"] / plain
    sizes = [len(part) for part in partition]
    return {"workload": workload.describe(), "client_samples_per_round":
            workload.clients_per_round * workload.local_steps * workload.batch_size,
            "client_sizes": {"min": min(sizes), "median": statistics.median(sizes), "max": max(sizes)},
            "first_round_max_abs_difference_to_plain": differences, "fit_command": command,
            "fit_wall_seconds": wall, "rows": rows}


def print_workload(result: dict) -> None:
    sizes = result["client_sizes"]
    print(f"\n{result['workload']} ({result['client_samples_per_round']:,} client-samples per round; client sizes "
          f"{sizes['min']}..{sizes['max']}, median {sizes['median']:g})")
    print(f"{'workload':<10}{'method':<28}{'timed':<26}{'ranks x threads':>16}{'median s/round':>16}"
          f"{'min':>8}{'max':>8}{'vs (a)':>8}")
    for row in result["rows"]:
        timed_as = "subprocess, metrics.jsonl" if row["ranks"] > 1 else "in-process run_round"
        print(f"{result['workload'][:2]:<10}{row['method']:<28}{timed_as:<26}"
              f"{row['ranks']:>10} x {row['threads_per_rank']:<3}{row['median_seconds']:>16.3f}"
              f"{min(row['round_seconds']):>8.3f}{max(row['round_seconds']):>8.3f}{row['vs_plain_loop']:>8.2f}")
    differences = ", ".join(f"{name} {value:.1e}" for name, value in
                            result["first_round_max_abs_difference_to_plain"].items())
    print(f"after the warm-up round, largest |parameter difference| to (a): {differences}")
    if result["fit_wall_seconds"] is not None:
        print(f"(d) whole fit run, start-up and final evaluation included: {result['fit_wall_seconds']:.1f} s")


def format_load(load: Sequence[float]) -> str:
    return " ".join(f"{value:.2f}" for value in load)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    train, test = load_dataset("cifar10", args.data_root)
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    print(f"FedAvg, {MODEL}, CIFAR-10 from {args.data_root} (Dirichlet alpha {ALPHA}, min {MIN_SAMPLES} samples, "
          f"seed {SEED}, no augmentation), client SGD lr {LR} momentum {MOMENTUM}")
    print(f"CPU: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"in-process threads {torch.get_num_threads()}; 1 warm-up round, then {args.repeats} timed rounds per "
          f"method, (a)-(c) taking turns; (d) {1 + args.repeats} rounds, the first left out")
    report = {"settings": {"model": MODEL, "lr": LR, "momentum": MOMENTUM, "alpha": ALPHA, "min_samples": MIN_SAMPLES,
                           "seed": SEED, "repeats": args.repeats, "cpu_count": os.cpu_count(),
                           "torch": torch.__version__, "in_process_threads": torch.get_num_threads(),
                           "python": platform.python_version(), "load_average_start": os.getloadavg()},
              "workloads": []}
    for name in args.workloads:
        result = run_workload(WORKLOADS[name], args, fabric, train, test)
        print_workload(result)
        report["workloads"].append(result)
    report["total_seconds"] = time.perf_counter() - started
    report["load_average_end"] = os.getloadavg()
    print(f"\ntotal {report['total_seconds']:.0f} s; load average (1, 5, 15 min) at the start "
          f"{format_load(report['settings']['load_average_start'])}, at the end "
          f"{format_load(report['load_average_end'])}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
