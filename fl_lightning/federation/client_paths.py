"""How a rank's clients run (`compute.client_path`, `compute.group_size`): decided once per run,
from the settings, the algorithm and the device, and passed on as one `ClientPath`."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from fl_lightning.algorithms.base import Algorithm
from fl_lightning.config import ComputeArgs


class Grouping(enum.Enum):
    ALONE = "alone"
    """One client after another."""
    VECTORISED = "vectorised"
    """Groups of clients in lockstep, the algorithm's rule under `torch.func.vmap`."""
    FUSED = "fused"
    """Groups of clients each computed as one client (`Algorithm.fuses_clients`)."""


@dataclass(frozen=True)
class ClientPath:
    grouping: Grouping
    group_size: Optional[int] = None
    """The most clients in a group (None: all of a rank's clients that can share one)."""

    @property
    def grouped(self) -> bool:
        return self.grouping is not Grouping.ALONE

    @classmethod
    def of(cls, compute: ComputeArgs, algorithm: Algorithm, device: torch.device, batch_size: int) -> "ClientPath":
        fused = algorithm.fuses_clients
        if fused and algorithm.client_state:
            raise TypeError(f"{type(algorithm).__name__}.fuses_clients is true, but a fused group keeps no "
                            f"client state ({', '.join(algorithm.client_state)}): it must be false")
        if not uses_grouped_path(compute.client_path, device, fused):
            return cls(Grouping.ALONE)
        return cls(Grouping.FUSED if fused else Grouping.VECTORISED,
                   group_size_for(compute.group_size, device, fused, batch_size))


def uses_grouped_path(client_path: str, device: torch.device, fused: bool = False) -> bool:
    """`auto` groups on a GPU, and on the CPU only clients that are `fused`: there, batched
    convolutions over the clients' own weights measured slower than the loop except for tiny models
    at tiny batches, while fused clients measured as fast or faster (docs/performance.md)."""
    return client_path == "grouped" or (client_path == "auto" and (device.type == "cuda" or fused))


CPU_FUSED_SAMPLES = 512
"""The most samples one fused pass takes on the CPU unless `compute.group_size` says otherwise."""


def group_size_for(group_size: Optional[int], device: torch.device, fused: bool, batch_size: int) -> Optional[int]:
    """`group_size`, or if null: all of a rank's clients, except fused clients on the CPU, grouped to
    passes of at most `CPU_FUSED_SAMPLES` samples: there larger passes measured slower (down to
    slower than the loop), and smaller ones faster than the loop but less so (docs/performance.md)."""
    if group_size is None and fused and device.type == "cpu":
        return max(1, CPU_FUSED_SAMPLES // batch_size)
    return group_size
