"""FedDyn (Acar et al. 2021), in the form of the authors' code.

Each client k keeps h_k (zero until it first trains), its estimate of the gradient of its loss at
its last local model. Local steps use g - h_k + alpha (y - x), which is the gradient of the
dynamically regularised loss L_k(y) - <h_k, y> + (alpha / 2) |y - x|^2; afterwards
h_k <- h_k - alpha (y_k - x). The server keeps h <- h - (alpha / N) sum_{k in S} (y_k - x) with N
all the clients and sets x <- mean_{k in S} y_k - h / alpha.

Partial participation, as in the paper (Algorithm 1): S is the set of clients whose uploads reached
the server (online, drawn and not dropped); the clients outside it keep their h_k, and a round in
which no upload arrives leaves x and h as they were (the round loop skips the server's step).

That server rule is expressed as the pseudo-gradient x - (mean y_k - h / alpha), so the default
server optimizer (SGD, lr 1, no momentum) applies it exactly. Another server optimizer steps on the
same pseudo-gradient, e.g. SGD with lr gamma gives x + gamma (mean y_k - h / alpha - x), a damped
FedDyn; h itself is updated as above either way.
"""

from __future__ import annotations

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm, train_locally
from fl_lightning.clients import ClientRound
from fl_lightning.errors import ConfigError
from fl_lightning.server_optimizers import ServerState

SERVER_H = "h"
CLIENT_H = "h_k"
LOCAL_CHANGE = "local_change"


class FedDyn(Algorithm):
    short_name = "feddyn"
    default_weighting = "uniform"
    # sum_k (y_k - x) for h is a sum, whatever the weights of the average of y_k.
    summed_uploads = (LOCAL_CHANGE,)
    client_state = (CLIENT_H,)

    def __init__(self, alpha: float = 0.01):
        """
        Args:
            alpha: weight of the dynamic regulariser (0.01 and 0.1 are common).
        """
        if alpha <= 0:
            raise ConfigError("algorithm.init_args.alpha", "a value > 0 (the server divides by it)", alpha)
        self.alpha = alpha

    def initial_server_state(self, num_params: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {SERVER_H: torch.zeros(num_params, device=device)}

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        global_params = client.global_params
        client_h = client.state.get(CLIENT_H, torch.zeros_like(global_params))
        local_params = train_locally(
            client, direction=lambda params, gradient, _: gradient + self.alpha * (params - global_params) - client_h
        )
        local_change = local_params - global_params
        client.state[CLIENT_H] = client_h - self.alpha * local_change
        return {PSEUDO_GRADIENT: -local_change, LOCAL_CHANGE: local_change}

    def server_update(self, state: ServerState, params: torch.Tensor, aggregate: dict[str, torch.Tensor]) -> None:
        h = state.tensors[SERVER_H]
        h -= self.alpha / state.num_clients * aggregate[LOCAL_CHANGE]
        # aggregate[PSEUDO_GRADIENT] = x - mean y_k, so this is x - (mean y_k - h / alpha).
        state.step(params, aggregate[PSEUDO_GRADIENT] + h / self.alpha)
