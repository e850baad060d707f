"""What the diagnostics cost: seconds per measured round of each diagnostic against the plain round,
and the round time of rounds on which no diagnostic is due, all measured in the same run.

Two CTP-FL federations train side by side from the same start on random uint8 CIFAR-shaped images
(as benchmarks/throughput.py): one plain, one with `DisplacementBias` and `Landscape` due every
`--every` rounds. They take turns round by round, so a slowdown of a shared machine hits both
alike. Each diagnostic's cost is the time it reports in its own metric (`ctpfl/seconds`: the extra
gradient at x^r on every client's batches; `hessian/seconds`: the Lanczos and Hutchinson products);
the table also gives whole rounds (the round and its hooks) with and without diagnostics due. The
diagnostics leave training unchanged, so both federations end with the same model (checked).

    python benchmarks/diagnostics.py
    python benchmarks/diagnostics.py --model resnet18 --device cuda --subset-size 2000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from lightning.fabric import Fabric

from fl_lightning.algorithms.ctpfl import CTPFL
from fl_lightning.config import DataArgs, FederationArgs, ModelArgs
from fl_lightning.data import ImageDataset
from fl_lightning.data.datasets import CIFAR10_MEAN, CIFAR10_STD
from fl_lightning.diagnostics.ctpfl import DisplacementBias
from fl_lightning.diagnostics.landscape import Landscape
from fl_lightning.federation.loop import FederatedLoop
from fl_lightning.federation.setup import RunData, RunSettings, rank_inputs
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
    device_description,
    random_images,
    synchronise,
)

SERVER_LR = 0.01

PLAIN = "plain round (no diagnostics)"
UNMEASURED = "round, no diagnostic due"
MEASURED = "round, both diagnostics due"
BIAS = "  DisplacementBias (ctpfl/seconds)"
LANDSCAPE = "  Landscape (hessian/seconds)"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, clients=5, local_steps=10,
                         repeats_help="timed rounds of each kind (with and without diagnostics due); medians are "
                                      "reported")
    parser.add_argument("--every", type=int, default=2, help="the diagnostics' schedule")
    parser.add_argument("--subset-size", type=int, default=500, help="Landscape: samples in its subset")
    parser.add_argument("--iterations", type=int, default=20, help="Landscape: Lanczos iterations")
    parser.add_argument("--probes", type=int, default=10, help="Landscape: Hutchinson probes")
    parser.add_argument("--hvp", choices=("jvp", "double_backward"), default="jvp")
    return parser.parse_args(argv)


def federation(fabric: Fabric, args: argparse.Namespace) -> FederatedLoop:
    """A CTP-FL loop set up as `federation.train` sets one up on one rank, on random data, its run
    assembled as `fit` assembles it (the model initialised from the seed)."""
    total = args.clients * SAMPLES_PER_CLIENT
    images, labels = random_images(total)
    dataset = ImageDataset(images, labels, NUM_CLASSES, CIFAR10_MEAN, CIFAR10_STD)
    settings = RunSettings(
        algorithm=CTPFL(), model=ModelArgs(name=args.model), data=DataArgs(augment=False),
        federation=FederationArgs(rounds=10**6, num_clients=args.clients, clients_per_round=args.clients,
                                  local_steps=args.local_steps, batch_size=args.batch_size),
        server_optimizer=ServerSGD(lr=SERVER_LR), seed=SEED,
    )
    partition = [indices.numpy() for indices in torch.arange(total).split(SAMPLES_PER_CLIENT)]
    run = rank_inputs(settings, out_dir=Path("benchmark-run"), run_id="benchmark", hyperparameters={},
                    data=RunData(dataset, dataset, partition))
    return FederatedLoop(fabric, run)


def timed_round(fabric: Fabric, loop: FederatedLoop, round_index: int) -> tuple[float, dict]:
    """One round with the hooks around it, as `federation.train` runs it."""
    synchronise(fabric.device)
    started = time.perf_counter()
    fabric.call("on_round_start", fabric, loop, round_index)
    metrics = loop.run_round(round_index)
    fabric.call("on_round_end", fabric, loop, metrics)
    synchronise(fabric.device)
    return time.perf_counter() - started, metrics


def main(argv: Optional[Sequence[str]] = None) -> dict[str, float]:
    """Print the settings and the table; return the median seconds by row."""
    args = parse_args(argv)
    apply_threads(args.threads)
    diagnostics = [DisplacementBias(every=args.every),
                   Landscape(every=args.every, subset_size=args.subset_size, batch_size=args.subset_size,
                             iterations=args.iterations, probes=args.probes, hvp=args.hvp)]
    plain_fabric = Fabric(accelerator=args.device, devices=1, precision=args.precision)
    measured_fabric = Fabric(accelerator=args.device, devices=1, precision=args.precision, callbacks=diagnostics)
    plain, measured = federation(plain_fabric, args), federation(measured_fabric, args)
    measured_fabric.call("on_fit_start", measured_fabric, measured)

    seconds: dict[str, list[float]] = {PLAIN: [], UNMEASURED: [], MEASURED: [], BIAS: [], LANDSCAPE: []}
    # Rounds up to the first measured one warm up (lazy initialisation, allocator, kernel choice).
    warm_up = args.every
    for round_index in range(warm_up + args.every * args.repeats):
        plain_seconds, _ = timed_round(plain_fabric, plain, round_index)
        measured_seconds, metrics = timed_round(measured_fabric, measured, round_index)
        if round_index < warm_up:
            continue
        seconds[PLAIN].append(plain_seconds)
        if "hessian/seconds" in metrics:
            seconds[MEASURED].append(measured_seconds)
            seconds[BIAS].append(metrics["ctpfl/seconds"])
            seconds[LANDSCAPE].append(metrics["hessian/seconds"])
        else:
            seconds[UNMEASURED].append(measured_seconds)
    same_model = torch.equal(plain.global_model.params, measured.global_model.params)

    medians = {name: statistics.median(values) for name, values in seconds.items() if values}
    baseline = medians[PLAIN]
    num_params = plain.global_model.params.numel()
    print(f"model {args.model} ({num_params:,} parameters), CTP-FL, {args.clients} clients x {args.local_steps} "
          f"local steps x batch {args.batch_size} (random uint8 {CHANNELS}x{IMAGE_SIZE}x{IMAGE_SIZE})")
    print(f"diagnostics every {args.every} rounds: DisplacementBias; Landscape on {args.subset_size} samples, "
          f"{args.iterations} Lanczos iterations, {args.probes} Hutchinson probes, hvp {args.hvp}")
    print(f"device {device_description(plain_fabric.device)}, precision {args.precision}, torch {torch.__version__}, "
          f"CPU threads: {torch.get_num_threads()}; {warm_up} warm-up rounds, then the median of "
          f"{len(seconds[PLAIN])} plain rounds, {len(seconds[UNMEASURED])} unmeasured and "
          f"{len(seconds[MEASURED])} measured rounds")
    print(f"{'':<38}{'seconds':>10}{'min':>10}{'max':>10}{'vs plain':>10}")
    for name, values in seconds.items():
        if values:
            print(f"{name:<38}{medians[name]:>10.3f}{min(values):>10.3f}{max(values):>10.3f}"
                  f"{medians[name] / baseline:>10.2f}")
    print(f"final models of the plain and the measured federation bitwise equal: {same_model}")
    return {**medians, "same_model": float(same_model)}


if __name__ == "__main__":
    main()
