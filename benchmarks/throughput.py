"""Client-samples per second of fl-lightning's client paths, against two references measured in the
same run: centralised training of the same model on the round's concatenated batch (batch S * B:
the ceiling, what one big batch gets out of the device), and a one-client-at-a-time loop with a
model copy and a `torch.optim.SGD` per client (FedAvg as most FL frameworks run it).

A client-sample is one sample in one local-training mini-batch; a round of S clients with K local
steps of batch B processes S * K * B of them, and centralised training takes K steps of batch
S * B. fl-lightning runs each algorithm of `--algorithms` (by default FedAvg, SCAFFOLD, FedProx and
CTP-FL; also FedAvgM and MOON) on both client paths of `ComputeArgs.client_path`: `loop` (one
client after another) and `grouped` (a rank's clients computed together; CTP-FL's fused, one
backward pass per query point), each run assembled as `fl-lightning fit` assembles it
(`fl_lightning.federation.setup.rank_inputs`: the algorithm's server optimizer and model). Every method
reads the same random uint8 images of the chosen shape, split IID over the clients as `fit` splits
them, from the device through the same normalising transform (no augmentation, no download), so
only the training loops differ.

For each fl-lightning method the last timed round also measures the share of the round spent
outside the clients' updates (`outside clients`): sampling, the aggregation and its all-reduce, the
server step and the checks, against the time spent producing the clients' updates (setting up each
client, its batches and its update), timed with the device synchronised at both ends of every
update (one synchronisation per client or group, which costs the round next to nothing).

Methods take turns within each repeat (after one warm-up round each), so a slowdown of a shared
machine hits all of them alike; the median over the timed rounds is reported, with its ratio to
the ceiling and to the naive loop, and on CUDA each method's peak memory
(`torch.cuda.max_memory_allocated` over its timed rounds, reset before each round). `--json PATH`
writes every setting and figure as one JSON file.

    python benchmarks/throughput.py
    python benchmarks/throughput.py --model resnet18 --num-classes 100 --device cuda --precision bf16-mixed \\
        --clients 10 --local-steps 50 --batch-size 50 --json resnet18.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional, Sequence
from unittest import mock

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

import fl_lightning.federation.loop
from fl_lightning.algorithms import CTPFL, MOON, SCAFFOLD, FedAvg, FedAvgM, FedProx
from fl_lightning.clients.run import CLIENT_STREAM, Batch, batch_positions, seeded_generator
from fl_lightning.config import ClientOptimizerArgs, ComputeArgs, DataArgs, FederationArgs, ModelArgs
from fl_lightning.data import DeviceTransform, ImageDataset, partition_indices
from fl_lightning.federation.loop import FederatedLoop
from fl_lightning.federation.setup import RunData, RunSettings, initial_network, rank_inputs
from fl_lightning.server_optimizers import ServerSGD

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also when loaded by path
from common import (  # noqa: E402
    CHANNELS,
    IMAGE_SIZE,
    NUM_CLASSES,
    SAMPLES_PER_CLIENT,
    SEED,
    add_common_arguments,
    apply_threads,
    normalisation,
    random_images,
    synchronise,
)

# Throughput does not depend on the learning rate; fixed so runs are comparable.
LEARNING_RATE = 0.01

CENTRALISED = "centralised (batch S*B)"
NAIVE_FEDERATED = "naive loop (FedAvg)"
CLIENT_PATHS = ("loop", "grouped")
# Name on the command line -> (label, algorithm factory, server lr). Server lr 1 with FedAvg is plain
# averaging, the same update as the naive loop's; CTP-FL's server lr is its step along the direction.
ALGORITHMS = {
    "fedavg": ("FedAvg", FedAvg, 1.0),
    "scaffold": ("SCAFFOLD", SCAFFOLD, 1.0),
    "fedprox": ("FedProx", FedProx, 1.0),
    "ctpfl": ("CTP-FL", CTPFL, LEARNING_RATE),
    "fedavgm": ("FedAvgM", FedAvgM, 1.0),
    "moon": ("MOON", MOON, 1.0),
}
DEFAULT_ALGORITHMS = ("fedavg", "scaffold", "fedprox", "ctpfl")
WARM_UP_ROUNDS = 1


def fl_lightning_name(algorithm: str, client_path: str) -> str:
    """The method's name in the table and the JSON, e.g. `fl-lightning FedAvg loop`."""
    return f"fl-lightning {ALGORITHMS[algorithm][0]} {client_path}"


def algorithm_list(text: str) -> list[str]:
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ALGORITHMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(ALGORITHMS)}, got {text!r}")
    return list(dict.fromkeys(names))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, clients=10, local_steps=20,
                         repeats_help="timed rounds per method after one warm-up round; the median is reported")
    parser.add_argument("--channels", type=int, default=CHANNELS, help=f"image channels (default: {CHANNELS})")
    parser.add_argument("--image-size", type=int, default=IMAGE_SIZE,
                        help=f"side of the square images (default: {IMAGE_SIZE})")
    parser.add_argument("--num-classes", type=int, default=NUM_CLASSES, help=f"classes (default: {NUM_CLASSES})")
    parser.add_argument("--algorithms", type=algorithm_list, default=list(DEFAULT_ALGORITHMS),
                        help=f"comma-separated fl-lightning algorithms of {', '.join(ALGORITHMS)}, each run on the "
                             f"loop and the grouped client path (default: {','.join(DEFAULT_ALGORITHMS)})")
    parser.add_argument("--group-size", type=int, default=None,
                        help="ComputeArgs.group_size of the grouped path (default: all of the rank's clients)")
    parser.add_argument("--channels-last", action="store_true",
                        help="images and every model in channels-last layout (ComputeArgs.channels_last for "
                             "fl-lightning)")
    parser.add_argument("--json", type=Path, default=None, help="write every setting and figure to this JSON file")
    return parser.parse_args(argv)


class Workload:
    """The clients' data on the device and the order in which each client reads it."""

    def __init__(self, num_clients: int, local_steps: int, batch_size: int, device: torch.device,
                 channels: int = CHANNELS, image_size: int = IMAGE_SIZE, num_classes: int = NUM_CLASSES,
                 channels_last: bool = False):
        total = num_clients * SAMPLES_PER_CLIENT
        images, labels = random_images(total, channels, image_size, num_classes)
        self.images, self.labels = images.to(device), labels.to(device)
        # As fit splits a dataset (data.partition iid), kept on the CPU as federation.loop.train() keeps it.
        self.partition = partition_indices(labels.numpy(), num_clients, "iid", seed=SEED)
        self.client_indices = [torch.as_tensor(part) for part in self.partition]
        self.mean, self.std = normalisation(channels)
        # No augmentation: the benchmark compares training loops, and every method normalises alike.
        self.transform = DeviceTransform(self.mean, self.std, augment=False)
        self.num_clients = num_clients
        self.local_steps = local_steps
        self.batch_size = batch_size
        self.channels, self.image_size, self.num_classes = channels, image_size, num_classes
        self.channels_last = channels_last

    @property
    def dataset(self) -> ImageDataset:
        return ImageDataset(self.images, self.labels, self.num_classes, self.mean, self.std)

    @property
    def samples_per_round(self) -> int:
        return self.num_clients * self.local_steps * self.batch_size

    def batch(self, indices: torch.Tensor) -> Batch:
        """What `LocalTrainer.make_batches` makes of one batch without augmentation (in the chosen
        memory layout)."""
        indices = indices.to(self.images.device)
        inputs = self.transform(self.images[indices])
        if self.channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, self.labels[indices]

    def client_positions(self, client_id: int, round_index: int) -> list[torch.Tensor]:
        """The batch order `LocalTrainer.client_round` draws for this client and round, so the naive loop
        reads exactly the batches fl-lightning reads."""
        generator = seeded_generator(SEED, CLIENT_STREAM, round_index, client_id)
        return batch_positions(SAMPLES_PER_CLIENT, self.batch_size, self.local_steps, None, generator)


def sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, fabric: Fabric) -> None:
    inputs, targets = batch
    with fabric.autocast():
        # The same loss as ClassificationModule.training_step.
        loss = F.cross_entropy(model(inputs).float(), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def reference_model(network: nn.Module, workload: Workload, device: torch.device) -> nn.Module:
    model = copy.deepcopy(network).to(device)
    return model.to(memory_format=torch.channels_last) if workload.channels_last else model


class Centralised:
    """One model, one optimizer, K steps of the round's concatenated batch (S * B samples each): the
    same client-samples as a round, in the fewest and largest steps."""

    name = CENTRALISED

    def __init__(self, fabric: Fabric, network: nn.Module, workload: Workload):
        self.fabric = fabric
        self.workload = workload
        self.model = reference_model(network, workload, fabric.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE)
        self.all_indices = torch.cat(workload.client_indices)

    def run_round(self, round_index: int) -> None:
        workload = self.workload
        generator = seeded_generator(SEED, round_index)
        big_batch = workload.num_clients * workload.batch_size
        self.model.train()
        for positions in batch_positions(len(self.all_indices), big_batch, workload.local_steps, None, generator):
            sgd_step(self.model, self.optimizer, workload.batch(self.all_indices[positions]), self.fabric)


class NaiveFederated:
    """FedAvg as most FL frameworks run it: per client a deep copy of the global model and a fresh
    `torch.optim.SGD`, then a weighted average of the clients' state_dicts."""

    name = NAIVE_FEDERATED

    def __init__(self, fabric: Fabric, network: nn.Module, workload: Workload):
        self.fabric = fabric
        self.workload = workload
        self.global_model = reference_model(network, workload, fabric.device)
        sizes = [len(indices) for indices in workload.client_indices]
        self.weights = [size / sum(sizes) for size in sizes]

    def run_round(self, round_index: int) -> None:
        workload = self.workload
        global_state = self.global_model.state_dict()
        # Integer buffers (BatchNorm's batch counter) are not averaged, as in fl-lightning.
        averaged = {name: torch.zeros_like(tensor)
                    for name, tensor in global_state.items() if tensor.is_floating_point()}
        for client_id, (indices, weight) in enumerate(zip(workload.client_indices, self.weights)):
            local_model = copy.deepcopy(self.global_model)
            local_model.train()
            optimizer = torch.optim.SGD(local_model.parameters(), lr=LEARNING_RATE)
            for positions in workload.client_positions(client_id, round_index):
                sgd_step(local_model, optimizer, workload.batch(indices[positions]), self.fabric)
            for name, tensor in local_model.state_dict().items():
                if name in averaged:
                    averaged[name].add_(tensor, alpha=weight)
        for name, tensor in averaged.items():
            global_state[name].copy_(tensor)


def run_settings(model_name: str, workload: Workload, algorithm: str, compute: ComputeArgs) -> RunSettings:
    """The settings of a `fit` run that trains this workload's round (data.name aside: the benchmark
    gives its random images)."""
    _, factory, server_lr = ALGORITHMS[algorithm]
    return RunSettings(
        algorithm=factory(), model=ModelArgs(name=model_name), data=DataArgs(partition="iid", augment=False),
        federation=FederationArgs(rounds=10**6, num_clients=workload.num_clients,
                                  clients_per_round=workload.num_clients, local_steps=workload.local_steps,
                                  batch_size=workload.batch_size),
        client_optimizer=ClientOptimizerArgs(lr=LEARNING_RATE), server_optimizer=ServerSGD(lr=server_lr),
        compute=compute, seed=SEED,
    )


class FlLightning:
    """The product's round: a `FederatedLoop` set up as `federation.loop.train()` sets it up on one rank,
    timed through its `run_round` (every client's update, the aggregation and the server step)."""

    def __init__(self, fabric: Fabric, model_name: str, workload: Workload, algorithm: str, compute: ComputeArgs):
        self.name = fl_lightning_name(algorithm, compute.client_path)
        self.algorithm, self.client_path = algorithm, compute.client_path
        dataset = workload.dataset
        run = rank_inputs(run_settings(model_name, workload, algorithm, compute), out_dir=Path("benchmark-run"),
                        run_id="benchmark", hyperparameters={}, data=RunData(dataset, dataset, workload.partition))
        self.loop = FederatedLoop(fabric, run)
        self.module = self.loop.module

    def run_round(self, round_index: int) -> None:
        self.loop.run_round(round_index)

    @contextlib.contextmanager
    def timing_client_updates(self) -> Iterator[list[float]]:
        """Within: the seconds spent producing each client's (or group's) update, appended to the list
        yielded."""
        device = self.loop.engine.device
        seconds: list[float] = []
        client_updates = fl_lightning.federation.loop.client_updates

        def timed_client_updates(*args, **kwargs):
            updates = client_updates(*args, **kwargs)
            while True:
                synchronise(device)
                started = time.perf_counter()
                update = next(updates, None)
                synchronise(device)
                seconds.append(time.perf_counter() - started)
                if update is None:
                    return
                yield update

        with mock.patch.object(fl_lightning.federation.loop, "client_updates", timed_client_updates):
            yield seconds


Method = Centralised | NaiveFederated | FlLightning


def build_methods(fabric: Fabric, model_name: str, workload: Workload, algorithms: Sequence[str] = DEFAULT_ALGORITHMS,
                  group_size: Optional[int] = None) -> list[Method]:
    """The ceiling, the naive loop, then each algorithm on the loop and the grouped path, all from the
    same initial model (as fit initialises it; prepared by each algorithm)."""
    network = initial_network(ModelArgs(name=model_name), workload.dataset, SEED)
    methods: list[Method] = [Centralised(fabric, network, workload), NaiveFederated(fabric, network, workload)]
    for algorithm in algorithms:
        for client_path in CLIENT_PATHS:
            compute = ComputeArgs(client_path=client_path, group_size=group_size,
                                  channels_last=workload.channels_last)
            methods.append(FlLightning(fabric, model_name, workload, algorithm, compute))
    return methods


def timed_round(method: Method, round_index: int, device: torch.device) -> tuple[float, Optional[int], Optional[int]]:
    """Seconds of one round; on CUDA also its peak allocated bytes and the peak above what was
    allocated when the round started (the round's own working memory)."""
    cuda = device.type == "cuda"
    synchronise(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    method.run_round(round_index)
    synchronise(device)
    seconds = time.perf_counter() - started
    if not cuda:
        return seconds, None, None
    peak = torch.cuda.max_memory_allocated(device)
    return seconds, peak, peak - start_bytes


def git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def settings_of(args: argparse.Namespace, fabric: Fabric, workload: Workload, num_params: int) -> dict:
    device = fabric.device
    return {
        "model": args.model, "parameters": num_params,
        "channels": args.channels, "image_size": args.image_size, "num_classes": args.num_classes,
        "clients": args.clients, "local_steps": args.local_steps, "batch_size": args.batch_size,
        "centralised_batch_size": args.clients * args.batch_size, "samples_per_client": SAMPLES_PER_CLIENT,
        "client_samples_per_round": workload.samples_per_round,
        "algorithms": list(args.algorithms), "client_paths": list(CLIENT_PATHS), "group_size": args.group_size,
        "precision": args.precision, "channels_last": args.channels_last,
        "warm_up_rounds": WARM_UP_ROUNDS, "timed_rounds": args.repeats, "client_lr": LEARNING_RATE,
        "data": "random uint8, no augmentation",
        "device": args.device, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(), "git_commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv: Optional[Sequence[str]] = None) -> dict[str, float]:
    """Print the settings and the table, write the JSON if asked; return the median client-samples
    per second by method. A method that fails is reported (and recorded in the JSON) while the
    others go on; then the script exits with status 1."""
    args = parse_args(argv)
    apply_threads(args.threads)
    fabric = Fabric(accelerator=args.device, devices=1, precision=args.precision)
    device = fabric.device
    workload = Workload(args.clients, args.local_steps, args.batch_size, device, args.channels, args.image_size,
                        args.num_classes, args.channels_last)
    methods = build_methods(fabric, args.model, workload, args.algorithms, args.group_size)
    num_params = sum(p.numel() for p in methods[0].model.parameters())

    seconds: dict[str, list[float]] = {method.name: [] for method in methods}
    peaks: dict[str, list[int]] = {method.name: [] for method in methods}
    working: dict[str, list[int]] = {method.name: [] for method in methods}
    errors: dict[str, str] = {}
    outside_clients: dict[str, float] = {}
    last_round = WARM_UP_ROUNDS + args.repeats - 1
    # The warm-up round (lazy initialisation, allocator growth, kernel selection) is left out of the
    # timing; methods take turns within each repeat, so a slowdown of a shared machine hits all alike.
    for round_index in range(WARM_UP_ROUNDS + args.repeats):
        for method in methods:
            if method.name in errors:
                continue
            try:
                timing = method.timing_client_updates() if isinstance(method, FlLightning) and \
                    round_index == last_round else contextlib.nullcontext()
                with timing as inside_seconds:
                    round_seconds, peak, above_start = timed_round(method, round_index, device)
                if inside_seconds is not None:
                    outside_clients[method.name] = 1 - sum(inside_seconds) / round_seconds
            except Exception as error:  # an out-of-memory grouped path must not lose the other figures
                errors[method.name] = f"round {round_index}: {type(error).__name__}: {error}"
                traceback.print_exc()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            if round_index < WARM_UP_ROUNDS:
                continue
            seconds[method.name].append(round_seconds)
            if peak is not None:
                peaks[method.name].append(peak)
                working[method.name].append(above_start)

    rates = {name: [workload.samples_per_round / s for s in values] for name, values in seconds.items()
             if name not in errors}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ceiling, naive = medians.get(CENTRALISED), medians.get(NAIVE_FEDERATED)
    results = []
    for method in methods:
        name = method.name
        row = {"method": name, "algorithm": getattr(method, "algorithm", None),
               "client_path": getattr(method, "client_path", None), "round_seconds": seconds[name],
               "peak_memory_bytes": max(peaks[name]) if peaks[name] else None,
               "round_memory_bytes": max(working[name]) if working[name] else None,
               "outside_clients": outside_clients.get(name)}
        if name in errors:
            row["error"] = errors[name]
        else:
            row.update({"samples_per_second": medians[name], "min_samples_per_second": min(rates[name]),
                        "max_samples_per_second": max(rates[name]),
                        "vs_centralised": medians[name] / ceiling if ceiling else None,
                        "vs_naive_loop": medians[name] / naive if naive else None})
        results.append(row)
    settings = settings_of(args, fabric, workload, num_params)
    print_table(settings, results)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": settings, "results": results, "errors": errors}, indent=2)
                             + "\n")
        print(f"wrote {args.json}")
    if errors:
        for name, error in errors.items():
            print(f"FAILED {name}: {error}", file=sys.stderr)
        raise SystemExit(1)
    return medians


def print_table(settings: dict, results: list[dict]) -> None:
    shape = f"{settings['channels']}x{settings['image_size']}x{settings['image_size']}"
    print(f"model {settings['model']} ({settings['parameters']:,} parameters), {settings['clients']} clients x "
          f"{settings['local_steps']} local steps x batch {settings['batch_size']} "
          f"= {settings['client_samples_per_round']:,} client-samples per round, {SAMPLES_PER_CLIENT} samples per "
          f"client (random uint8 {shape}, {settings['num_classes']} classes, no augmentation); centralised: "
          f"{settings['local_steps']} steps of batch {settings['centralised_batch_size']}")
    device = settings["device"] + (f" ({settings['device_name']})" if settings["device_name"] else "")
    print(f"device {device}, precision {settings['precision']}, channels-last {settings['channels_last']}, "
          f"torch {settings['torch']}, CPU threads: {settings['cpu_threads']}; {WARM_UP_ROUNDS} warm-up round, "
          f"then the median of {settings['timed_rounds']} timed rounds per method")
    memory = settings["device"] == "cuda"
    print(f"{'method':<32}{'samples/s':>12}{'min':>12}{'max':>12}{'vs centralised':>16}{'vs naive':>10}"
          f"{'outside clients':>17}" + (f"{'peak MiB':>10}{'round MiB':>10}" if memory else ""))
    for row in results:
        if "error" in row:
            print(f"{row['method']:<32}  FAILED: {row['error']}")
            continue
        line = (f"{row['method']:<32}{row['samples_per_second']:>12.1f}{row['min_samples_per_second']:>12.1f}"
                f"{row['max_samples_per_second']:>12.1f}{_ratio(row['vs_centralised']):>16}"
                f"{_ratio(row['vs_naive_loop']):>10}{_percent(row['outside_clients']):>17}")
        if memory:
            line += f"{row['peak_memory_bytes'] / 2**20:>10.0f}{row['round_memory_bytes'] / 2**20:>10.0f}"
        print(line)


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


if __name__ == "__main__":
    main()
