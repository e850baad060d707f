"""What the benchmarks share: their common command-line options, the clock's synchronisation with the
device, and the random uint8 images they train on.

The scripts import it as `common` (they put their own folder on `sys.path`, so this also works when
a test loads a script by its path).
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch

from fl_lightning.data.datasets import CIFAR10_MEAN, CIFAR10_STD
from fl_lightning.models import registered_models

SAMPLES_PER_CLIENT = 500
NUM_CLASSES = 10
CHANNELS, IMAGE_SIZE = 3, 32
# Timings do not depend on the seed; fixed so runs are comparable.
SEED = 0


def add_common_arguments(parser: argparse.ArgumentParser, *, clients: int, local_steps: int,
                         repeats_help: str) -> None:
    """The model, the round's shape (clients x local steps x batch), the device, the precision, the
    repeats and the CPU threads, with the given defaults."""
    parser.add_argument("--model", default="lenet5",
                        help=f"{', '.join(registered_models())} or a timm model name (default: lenet5)")
    parser.add_argument("--clients", type=int, default=clients,
                        help=f"clients per round, all trained every round (default: {clients})")
    parser.add_argument("--local-steps", type=int, default=local_steps,
                        help=f"mini-batches per client per round, K (default: {local_steps})")
    parser.add_argument("--batch-size", type=int, default=50, help="local mini-batch size B (default: 50)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    parser.add_argument("--repeats", type=int, default=3, help=repeats_help)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice); on a CPU shared with other work, "
                             "fewer threads than cores avoids threads waiting on a busy core")


def apply_threads(threads: Optional[int]) -> None:
    if threads is not None:
        torch.set_num_threads(threads)


def synchronise(device: torch.device) -> None:
    """Wait for queued kernels, so the clock measures work done rather than work launched."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_description(device: torch.device) -> str:
    """`cpu`, or `cuda (NVIDIA H200)`."""
    return f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else device.type


def normalisation(channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std for random images: CIFAR's for three channels, else 0.5 each (the
    values do not change the cost)."""
    if channels == len(CIFAR10_MEAN):
        return CIFAR10_MEAN, CIFAR10_STD
    return (0.5,) * channels, (0.5,) * channels


def random_images(total: int, channels: int = CHANNELS, image_size: int = IMAGE_SIZE,
                  num_classes: int = NUM_CLASSES, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """`total` random uint8 images [total, channels, image_size, image_size] and int64 labels, on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (total, channels, image_size, image_size), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, num_classes, (total,), generator=generator)
    return images, labels
