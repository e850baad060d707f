"""FedProx (Li et al. 2020): local SGD on the loss plus (mu / 2) |y - x|^2, which keeps each local
model near the global model x; its gradient adds mu (y - x) to every mini-batch gradient."""

from __future__ import annotations

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm, train_locally
from fl_lightning.clients import ClientRound
from fl_lightning.errors import ConfigError


class FedProx(Algorithm):
    short_name = "fedprox"

    def __init__(self, mu: float = 0.01):
        """
        Args:
            mu: weight of the proximal term; 0 is FedAvg.
        """
        if mu < 0:
            raise ConfigError("algorithm.init_args.mu", "a value >= 0", mu)
        self.mu = mu

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        global_params = client.global_params
        local_params = train_locally(
            client, direction=lambda params, gradient, _: gradient + self.mu * (params - global_params)
        )
        return {PSEUDO_GRADIENT: global_params - local_params}
