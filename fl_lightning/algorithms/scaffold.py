"""SCAFFOLD (Karimireddy et al. 2020), option II: control variates correct the client drift.

The server keeps a control c, each client its own c_i (zero until the client first trains, and
kept while it sits rounds out). Local steps use g - c_i + c. Afterwards
c_i+ = c_i - c + (x - y) / (K_i eta) with the client's own step count K_i and lr eta; the client
uploads x - y (averaged) and c_i+ - c_i (summed), and the server steps x with its optimizer on the
averaged x - y and sets c <- c + (1/N) sum_{i in S} (c_i+ - c_i) with N all the clients.

Partial participation, as in the paper (Algorithm 1, line 17): S is the set of clients whose
uploads reached the server, so c <- c + |S|/N * mean_{i in S} (c_i+ - c_i), whoever was offline
(`federation.participation`) or lost their upload (`federation.dropout`); an absent client's c_i,
and a dropped client's, stays as it was until its next reported round.

Option II assumes plain SGD. With local momentum beta, y moves about 1 / (1 - beta) times further
than K_i eta times the mean direction, so the literal formula (the default, as in the common
benchmark code) overestimates c_i by about that factor: with momentum 0.9 and every client taking
part each round it diverged on CIFAR-10. `effective_steps` divides by the distance the local
optimizer moves along a constant direction instead, which is K_i eta without momentum.
"""

from __future__ import annotations

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm, train_locally
from fl_lightning.algorithms.costs import Cost
from fl_lightning.clients import ClientRound
from fl_lightning.server_optimizers import ServerState

CONTROL = "control"
CONTROL_DELTA = "control_delta"


def momentum_steps(num_steps: int | torch.Tensor, momentum: float, nesterov: bool) -> float | torch.Tensor:
    """How far `num_steps` local SGD steps (momentum reset at the start) move along a constant unit
    direction, in units of the lr: sum over steps m of (1 - beta^m) / (1 - beta) for heavy ball,
    plus one per step (the direction itself) for Nesterov; `num_steps` without momentum."""
    if not momentum:
        return num_steps
    heavy_ball = (num_steps - momentum * (1 - momentum**num_steps) / (1 - momentum)) / (1 - momentum)
    return num_steps + momentum * heavy_ball if nesterov else heavy_ball


class SCAFFOLD(Algorithm):
    short_name = "scaffold"
    default_weighting = "uniform"
    summed_uploads = (CONTROL_DELTA,)
    client_state = (CONTROL,)
    cost = Cost(uploads=2, sent_down=(CONTROL,))  # x - y_i and c_i+ - c_i up, x and c down

    def __init__(self, effective_steps: bool = False):
        """
        Args:
            effective_steps: in c_i+, divide x - y by the distance the local optimizer (with its
                momentum) moves along a constant direction instead of by K_i * lr; the same without
                momentum.
        """
        self.effective_steps = effective_steps

    def initial_server_state(self, num_params: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {CONTROL: torch.zeros(num_params, device=device)}

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        server_control = client.server.tensors[CONTROL]
        client_control = client.state.get(CONTROL, torch.zeros_like(server_control))
        drift_correction = server_control - client_control
        local_params = train_locally(client, direction=lambda _, gradient, __: gradient + drift_correction)
        model_change = client.global_params - local_params
        new_client_control = client_control - server_control + model_change / self.step_length(client)
        client.state[CONTROL] = new_client_control
        return {PSEUDO_GRADIENT: model_change, CONTROL_DELTA: new_client_control - client_control}

    def step_length(self, client: ClientRound) -> float:
        """K_i * lr, or with `effective_steps` the momentum-aware distance per unit direction."""
        args = client.optimizer_args
        if self.effective_steps:
            return momentum_steps(client.num_steps, args.momentum, args.nesterov) * args.lr
        return client.num_steps * args.lr

    def server_update(self, state: ServerState, params: torch.Tensor, aggregate: dict[str, torch.Tensor]) -> None:
        super().server_update(state, params, aggregate)
        state.tensors[CONTROL] += aggregate[CONTROL_DELTA] / state.num_clients
