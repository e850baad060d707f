"""FedNova (Wang et al. 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization"): normalised averaging, the standard baseline for clients that do unequal local work.

Client i runs its tau_i local steps from x to y_i and uploads its normalised update
d_i = (x - y_i) / a_i, with a_i = ||a_i||_1 the distance its local optimizer moves along a constant
unit direction, in units of the lr: tau_i for plain SGD, sum over steps m of (1 - rho^m) / (1 - rho)
with heavy-ball momentum rho (the paper's section 4; Nesterov adds one per step), shared with
SCAFFOLD's `effective_steps`. The server steps x with its optimizer on

    tau_eff * sum_i p_i d_i,    tau_eff = sum_i p_i a_i,

over the clients that reported, p_i their sample shares (the paper's weights), so that with the
default server optimizer (SGD, lr 1) x <- x - tau_eff sum_i p_i d_i, the paper's update (its
equation 6 with w_i = p_i). With equal a_i this is FedAvg. Weight decay is left out of a_i, as a
constant L2 term the paper's derivation does not have (its authors' code folds FedProx's proximal
term in; this project's FedProx is another algorithm).
"""

from __future__ import annotations

import torch

from fl_lightning.algorithms.base import Algorithm, train_locally
from fl_lightning.algorithms.scaffold import momentum_steps
from fl_lightning.clients import ClientRound
from fl_lightning.server_optimizers import ServerState

NORMALISED_UPDATE = "normalised_update"
NORMALISING_STEPS = "normalising_steps"


class FedNova(Algorithm):
    short_name = "fednova"
    weighted_uploads = (NORMALISED_UPDATE,)
    weighted_short_uploads = {NORMALISING_STEPS: 1}

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        local_params = train_locally(client)
        args = client.optimizer_args
        steps = momentum_steps(client.num_steps, args.momentum, args.nesterov)
        model_change = client.global_params - local_params
        # steps is a number, or one client's tensor in a group: either way a vector of one element.
        return {NORMALISED_UPDATE: model_change / steps, NORMALISING_STEPS: steps * torch.ones_like(model_change[:1])}

    def server_update(self, state: ServerState, params: torch.Tensor, aggregate: dict[str, torch.Tensor]) -> None:
        state.step(params, aggregate[NORMALISING_STEPS] * aggregate[NORMALISED_UPDATE])
