"""FedSAM (Qu et al. 2022): local SGD with sharpness-aware steps. Each step takes the gradient g
at y, moves to y + rho g / |g| (over all parameters) and steps from y with the gradient there,
on the same mini-batch."""

from __future__ import annotations

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm
from fl_lightning.client import Batch, ClientRun
from fl_lightning.config import ConfigError


class FedSAM(Algorithm):
    short_name = "fedsam"
    default_weighting = "num_samples"

    def __init__(self, rho: float = 0.1):
        """
        Args:
            rho: radius of the ascent step; 0 is FedAvg.
        """
        if rho < 0:
            raise ConfigError("algorithm.init_args.rho", "a value >= 0", rho)
        self.rho = rho

    def client_update(self, client: ClientRun) -> dict[str, torch.Tensor]:
        local_params = client.global_params.clone()
        optimizer = client.local_sgd()
        for batch in client.batches():
            _, gradient = client.loss_and_grad(local_params, batch)
            ascent = self.rho / (gradient.norm() + 1e-12) * gradient
            optimizer.step(local_params, gradient_at_ascent_point(client, local_params + ascent, batch))
        return {PSEUDO_GRADIENT: client.global_params - local_params}


def gradient_at_ascent_point(client: ClientRun, params: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The gradient at `params` on `batch`, by a pass that does not count as a training step: the
    BatchNorm running stats it updates and the loss it records are put back, so both reflect the
    step's first pass only, as in FedAvg."""
    running_stats = client.buffers.clone()
    _, gradient = client.loss_and_grad(params, batch)
    client.buffers.copy_(running_stats)
    client.losses.pop()
    return gradient
