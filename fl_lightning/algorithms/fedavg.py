"""FedAvg (McMahan et al. 2017): local SGD; the server steps on sum_i p_i (x - y_i).

With the default server optimizer (SGD, lr 1) that is plain averaging; a server lr gamma gives
x + gamma * sum_i p_i (y_i - x).
"""

from __future__ import annotations

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm, train_locally
from fl_lightning.clients import ClientRound


class FedAvg(Algorithm):
    short_name = "fedavg"

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        local_params = train_locally(client)
        return {PSEUDO_GRADIENT: client.global_params - local_params}
