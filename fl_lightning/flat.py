"""One flat vector for a set of named tensors, with a named view of each.

The global model, each client's local model and every upload are flat float vectors: update rules
are then a few whole-vector operations, the aggregation is one buffer, and `views` gives the
per-tensor shapes back for the forward pass (`torch.func.functional_call`) and for per-layer rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch


@dataclass(frozen=True)
class FlatLayout:
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]

    @classmethod
    def of(cls, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> "FlatLayout":
        pairs = list(named_tensors)
        return cls(tuple(n for n, _ in pairs), tuple(t.shape for _, t in pairs))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(s.numel() for s in self.shapes)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if not self.names:
            return torch.zeros(0)
        return torch.cat([tensors[n].detach().reshape(-1).float() for n in self.names])

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views that share memory (and autograd history) with `flat`."""
        return {
            name: chunk.view(shape)
            for name, shape, chunk in zip(self.names, self.shapes, flat.split(self.numels))
        }
