"""FedAvg-M (Cheng et al., ICLR 2024), client-side momentum: every local step follows
beta g(y) + (1 - beta) g^r, where g^r, the global direction, is the previous round's aggregated local
step per unit lr (g^0 = 0); the server steps on sum_i p_i (x - y_i) as in FedAvg. Not FedAvgM
(`fedavg_server_momentum`), whose momentum is the server's.

g^{r+1} = sum_i p_i (x - y_i) / (lr K_i), K_i client i's number of local steps. The paper has
one K for every client, and then this is its (x^r - x^{r+1}) / (gamma lr K). With `local_epochs`
the K_i differ; dividing each client's update by its own K_i keeps g^r the size of one step's
gradient, the quantity it is mixed with, whatever the client's data size. It is a separate upload
because the server step needs the undivided update. The paper's clients run plain SGD; with client
momentum the local steps, and so g^r, grow by about 1 / (1 - momentum). The default beta = 0.1 is
FedCM's alpha for the same rule.
"""

from __future__ import annotations

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm, train_locally
from fl_lightning.algorithms.costs import Cost
from fl_lightning.clients import ClientRound
from fl_lightning.errors import ConfigError
from fl_lightning.server_optimizers import ServerOptimizer, ServerSGD, ServerState

MEAN_LOCAL_STEP = "mean_local_step"
"""A client's (x - y_i) / (lr K_i): its average local step direction."""
GLOBAL_DIRECTION = "global_direction"


def check_gradient_weight(field_name: str, value: float) -> None:
    # 0 would ignore the local gradients altogether (and never move, since g^0 = 0).
    if not 0 < value <= 1:
        raise ConfigError(field_name, "a value in (0, 1]", value)


class FedAvgClientMomentum(Algorithm):
    short_name = "fedavg_client_momentum"
    former_names = ("fedavg_m", "FedAvgMomentum")
    default_weighting = "uniform"
    weighted_uploads = (PSEUDO_GRADIENT, MEAN_LOCAL_STEP)
    # A deployed client sends x - y_i alone: the server knows lr and K_i. g^r goes down, unless it is the
    # server's last step over gamma lr K (`rebuilds_from_models`), as in the paper's full participation.
    cost = Cost(rebuilt_down=(GLOBAL_DIRECTION,))

    def __init__(self, beta: float = 0.1):
        """
        Args:
            beta: weight of the local gradient in each local step, in (0, 1]; 1 is FedAvg.
        """
        check_gradient_weight("algorithm.init_args.beta", beta)
        self.beta = beta

    @property
    def gradient_weight(self) -> float:
        """The local gradient's share of each local step; the global direction has the rest."""
        return self.beta

    def initial_server_state(self, num_params: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {GLOBAL_DIRECTION: torch.zeros(num_params, device=device)}

    def rebuilds_from_models(self, server_optimizer: ServerOptimizer, equal_steps: bool) -> bool:
        # g^{r+1} = sum_i p_i (x - y_i) / (lr K) = (x^r - x^{r+1}) / (gamma lr K) when every K_i is K and
        # the server steps plainly by gamma times the aggregate.
        return equal_steps and isinstance(server_optimizer, ServerSGD) and not server_optimizer.momentum

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        global_share = (1 - self.gradient_weight) * client.server.tensors[GLOBAL_DIRECTION]
        local_params = train_locally(
            client, direction=lambda _, gradient, __: self.gradient_weight * gradient + global_share
        )
        update = client.global_params - local_params
        return {PSEUDO_GRADIENT: update, MEAN_LOCAL_STEP: update / (client.optimizer_args.lr * client.num_steps)}

    def server_update(self, state: ServerState, params: torch.Tensor, aggregate: dict[str, torch.Tensor]) -> None:
        state.tensors[GLOBAL_DIRECTION] = aggregate[MEAN_LOCAL_STEP].clone()
        super().server_update(state, params, aggregate)

    def round_metrics(self, state: ServerState) -> dict[str, float]:
        return {"global_direction_norm": state.tensors[GLOBAL_DIRECTION].norm().item()}
