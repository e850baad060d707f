"""Constraints on local training, applied as a projection of each local update direction."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fl_lightning.flat import FlatLayout


class Constraint:
    """A linear constraint set on the local model, fixed by the global model of the round."""

    def prepare_model(self, network: nn.Module) -> None:
        """Check that the model suits the constraint and make the initial global model feasible."""

    def projection(self, global_params: torch.Tensor, layout: FlatLayout) -> Callable[[torch.Tensor], torch.Tensor]:
        """The map of local directions onto the constraint's null space for this round."""
        raise NotImplementedError
