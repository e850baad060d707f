"""Client-samples per second of fl-lightning's client path, against two references measured in the
same run: plain centralised training of the same model and batch (the ceiling), and a
one-client-at-a-time loop with a model copy and a `torch.optim.SGD` per client (what most FL
frameworks do).

A client-sample is one sample in one local-training mini-batch; a round of C clients with K local
steps of batch B processes C * K * B of them, and centralised training runs the same C * K steps.
Every method reads the same random uint8 CIFAR-shaped images from the device through the same
normalising transform, so only the training loops differ.

    python benchmarks/throughput.py
    python benchmarks/throughput.py --model resnet18 --device cuda --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from fl_lightning.algorithms.ctpfl import CTPFL
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.client import CLIENT_STREAM, Batch, batch_positions, seeded_generator
from fl_lightning.config import ClientOptimizerArgs, DataArgs, FederationArgs
from fl_lightning.data import DeviceTransform, ImageDataset
from fl_lightning.data.datasets import CIFAR10_MEAN, CIFAR10_STD
from fl_lightning.federation import FederatedLoop, FederatedRun
from fl_lightning.models import create_model, registered_models
from fl_lightning.module import ClassificationModule
from fl_lightning.server_optimizers import ServerSGD

SAMPLES_PER_CLIENT = 500
NUM_CLASSES = 10
CHANNELS, IMAGE_SIZE = 3, 32
# Throughput does not depend on the learning rate or the seed; fixed so runs are comparable.
LEARNING_RATE = 0.01
SEED = 0

CENTRALISED = "centralised"
NAIVE_FEDERATED = "naive federated"
FL_LIGHTNING_FEDAVG = "fl-lightning FedAvg"
FL_LIGHTNING_CTPFL = "fl-lightning CTP-FL"
FL_LIGHTNING_CTPFL_VECTORISED = "fl-lightning CTP-FL vmap"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="lenet5",
                        help=f"{', '.join(registered_models())} or a timm model name (default: lenet5)")
    parser.add_argument("--clients", type=int, default=10, help="clients per round, all trained every round")
    parser.add_argument("--local-steps", type=int, default=20, help="mini-batches per client per round (K)")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per method; the median is reported")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice); on a CPU shared with other work, "
                             "fewer threads than cores avoids threads waiting on a busy core")
    return parser.parse_args(argv)


def synchronise(device: torch.device) -> None:
    """Wait for queued kernels, so the clock measures work done rather than work launched."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Workload:
    """The clients' data on the device and the order in which each client reads it."""

    def __init__(self, num_clients: int, local_steps: int, batch_size: int, device: torch.device):
        generator = torch.Generator().manual_seed(SEED)
        total = num_clients * SAMPLES_PER_CLIENT
        self.images = torch.randint(0, 256, (total, CHANNELS, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8,
                                    generator=generator).to(device)
        self.labels = torch.randint(0, NUM_CLASSES, (total,), generator=generator).to(device)
        # Kept on the CPU, as federation.train() keeps the partition.
        self.client_indices = list(torch.arange(total).split(SAMPLES_PER_CLIENT))
        # No augmentation: the benchmark compares training loops, and every method normalises alike.
        self.transform = DeviceTransform(CIFAR10_MEAN, CIFAR10_STD, augment=False)
        self.num_clients = num_clients
        self.local_steps = local_steps
        self.batch_size = batch_size

    @property
    def samples_per_round(self) -> int:
        return self.num_clients * self.local_steps * self.batch_size

    def batch(self, indices: torch.Tensor) -> Batch:
        """What `LocalTrainer.make_batch` does without augmentation."""
        indices = indices.to(self.images.device)
        return self.transform(self.images[indices]), self.labels[indices]

    def client_positions(self, client_id: int, round_index: int) -> list[torch.Tensor]:
        """The batch order `LocalTrainer.client_run` draws for this client and round, so the naive loop
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


class Centralised:
    """One model, one optimizer, as many steps as a federated round takes in total."""

    name = CENTRALISED

    def __init__(self, fabric: Fabric, network: nn.Module, workload: Workload):
        self.fabric = fabric
        self.workload = workload
        self.model = copy.deepcopy(network).to(fabric.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE)
        self.all_indices = torch.cat(workload.client_indices)

    def run_round(self, round_index: int) -> None:
        workload = self.workload
        generator = seeded_generator(SEED, round_index)
        steps = workload.num_clients * workload.local_steps
        self.model.train()
        for positions in batch_positions(len(self.all_indices), workload.batch_size, steps, None, generator):
            sgd_step(self.model, self.optimizer, workload.batch(self.all_indices[positions]), self.fabric)


class NaiveFederated:
    """FedAvg as most FL frameworks run it: per client a deep copy of the global model and a fresh
    `torch.optim.SGD`, then a weighted average of the clients' state_dicts."""

    name = NAIVE_FEDERATED

    def __init__(self, fabric: Fabric, network: nn.Module, workload: Workload):
        self.fabric = fabric
        self.workload = workload
        self.global_model = copy.deepcopy(network).to(fabric.device)
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


class FlLightning:
    """The product's round: a `FederatedLoop` set up as `federation.train()` sets it up on one rank,
    timed through its `run_round` (every client's update, the aggregation and the server step)."""

    def __init__(self, name: str, fabric: Fabric, network: nn.Module, workload: Workload, algorithm,
                 server_lr: float):
        self.name = name
        dataset = ImageDataset(workload.images, workload.labels, NUM_CLASSES, CIFAR10_MEAN, CIFAR10_STD)
        run = FederatedRun(
            algorithm=algorithm, server_optimizer=ServerSGD(lr=server_lr),
            module=ClassificationModule(copy.deepcopy(network), NUM_CLASSES), train=dataset, test=dataset,
            partition=[indices.numpy() for indices in workload.client_indices],
            federation=FederationArgs(rounds=10**6, num_clients=workload.num_clients,
                                      clients_per_round=workload.num_clients, local_steps=workload.local_steps,
                                      batch_size=workload.batch_size),
            data=DataArgs(augment=False), client_optimizer=ClientOptimizerArgs(lr=LEARNING_RATE),
            checkpoint_keep=1, seed=SEED, out_dir=Path("benchmark-run"), run_id="benchmark", hyperparameters={},
        )
        self.loop = FederatedLoop(fabric, run)
        self.module = self.loop.module

    def run_round(self, round_index: int) -> None:
        self.loop.run_round(round_index)


def build_methods(fabric: Fabric, model_name: str,
                  workload: Workload) -> list[Centralised | NaiveFederated | FlLightning]:
    torch.manual_seed(SEED)
    network = create_model(model_name, NUM_CLASSES, CHANNELS, IMAGE_SIZE)
    return [
        Centralised(fabric, network, workload),
        NaiveFederated(fabric, network, workload),
        # Server lr 1 is plain averaging, the same update as the naive loop's.
        FlLightning(FL_LIGHTNING_FEDAVG, fabric, network, workload, FedAvg(), server_lr=1.0),
        FlLightning(FL_LIGHTNING_CTPFL, fabric, network, workload, CTPFL(), server_lr=LEARNING_RATE),
        FlLightning(FL_LIGHTNING_CTPFL_VECTORISED, fabric, network, workload, CTPFL(vectorise=True),
                    server_lr=LEARNING_RATE),
    ]


def timed_round(method, round_index: int, device: torch.device) -> float:
    synchronise(device)
    started = time.perf_counter()
    method.run_round(round_index)
    synchronise(device)
    return time.perf_counter() - started


def main(argv: Optional[Sequence[str]] = None) -> dict[str, float]:
    """Print the settings and the table; return the median client-samples per second by method."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    fabric = Fabric(accelerator=args.device, devices=1, precision=args.precision)
    device = fabric.device
    workload = Workload(args.clients, args.local_steps, args.batch_size, device)
    methods = build_methods(fabric, args.model, workload)
    num_params = sum(p.numel() for p in methods[0].model.parameters())

    # Warm-up round: lazy initialisation, allocator growth and kernel selection stay out of the timing.
    for method in methods:
        method.run_round(0)
    rates: dict[str, list[float]] = {method.name: [] for method in methods}
    # Methods take turns within each repeat, so a slowdown of a shared machine hits all of them alike.
    for repeat in range(args.repeats):
        for method in methods:
            seconds = timed_round(method, repeat + 1, device)
            rates[method.name].append(workload.samples_per_round / seconds)

    medians = {name: statistics.median(values) for name, values in rates.items()}
    ceiling = medians[CENTRALISED]
    device_name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"model {args.model} ({num_params:,} parameters), "
          f"{args.clients} clients x {args.local_steps} local steps x batch {args.batch_size} "
          f"= {workload.samples_per_round:,} client-samples per round, {SAMPLES_PER_CLIENT} samples per client "
          f"(random uint8 {CHANNELS}x{IMAGE_SIZE}x{IMAGE_SIZE}, {NUM_CLASSES} classes, no augmentation)")
    print(f"device {args.device}{device_name}, precision {args.precision}, torch {torch.__version__}, "
          f"CPU threads: {torch.get_num_threads()}; 1 warm-up round, then the median of {args.repeats} "
          f"timed rounds per method")
    print(f"{'method':<26}{'samples/s':>12}{'min':>12}{'max':>12}{'vs centralised':>16}")
    for name, values in rates.items():
        print(f"{name:<26}{medians[name]:>12.1f}{min(values):>12.1f}{max(values):>12.1f}"
              f"{medians[name] / ceiling:>16.2f}")
    return medians


if __name__ == "__main__":
    main()
