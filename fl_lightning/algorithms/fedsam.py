"""FedSAM (Qu et al. 2022): local SGD with sharpness-aware steps. Each step takes the gradient g
at y, moves to y + rho g / |g| (over all parameters) and steps from y with the gradient there,
on the same mini-batch."""

from __future__ import annotations

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm, train_locally
from fl_lightning.algorithms.costs import Cost, Passes
from fl_lightning.clients import Batch, ClientRound
from fl_lightning.errors import ConfigError


class FedSAM(Algorithm):
    short_name = "fedsam"
    cost = Cost(passes=Passes(forward=2, backward=2))  # the gradient at y, then at the ascent point

    def __init__(self, rho: float = 0.1):
        """
        Args:
            rho: radius of the ascent step; 0 is FedAvg.
        """
        if rho < 0:
            raise ConfigError("algorithm.init_args.rho", "a value >= 0", rho)
        self.rho = rho

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        def gradient_at_ascent_point(params: torch.Tensor, gradient: torch.Tensor, batch: Batch) -> torch.Tensor:
            ascent = self.rho / (gradient.norm() + 1e-12) * gradient
            # Not a training step: BatchNorm statistics and the recorded loss stay the first pass's.
            return client.loss_and_grad(params + ascent, batch, training_pass=False)[1]

        local_params = train_locally(client, direction=gradient_at_ascent_point)
        return {PSEUDO_GRADIENT: client.global_params - local_params}

