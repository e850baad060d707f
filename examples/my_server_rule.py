"""A server rule that needs one number per client: `--algorithm my_server_rule.FedExP` (with this folder
on PYTHONPATH).

FedExP (Jhunjhunwala et al., ICLR 2023): FedAvg whose server extrapolates, stepping by
eta = max(1, sum_i p_i |x - y_i|^2 / (2 (|sum_i p_i (x - y_i)|^2 + eps))) times the mean change. Each
client sends its squared norm beside its change: one number, aggregated in the same all-reduce and
counted at its size in `cost_upload_bytes`.
"""

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm, train_locally
from fl_lightning.clients import ClientRound
from fl_lightning.errors import ConfigError
from fl_lightning.server_optimizers import ServerState

SQUARED_NORM = "squared_norm"


class FedExP(Algorithm):
    default_weighting = "uniform"
    weighted_uploads = (PSEUDO_GRADIENT,)
    weighted_short_uploads = {SQUARED_NORM: 1}  # one number per client: sum_i p_i |x - y_i|^2 reaches the server

    def __init__(self, epsilon: float = 1e-3):
        """
        Args:
            epsilon: added to the denominator, so that clients agreeing exactly do not divide by zero.
        """
        if not epsilon > 0:
            raise ConfigError("algorithm.init_args.epsilon", "a number > 0", epsilon)
        self.epsilon = epsilon

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        change = client.global_params - train_locally(client)
        # A vector of one element, tensor arithmetic only, so that the rule also runs grouped.
        return {PSEUDO_GRADIENT: change, SQUARED_NORM: change.square().sum().reshape(1)}

    def server_update(self, state: ServerState, params: torch.Tensor, aggregate: dict[str, torch.Tensor]) -> None:
        mean_change = aggregate[PSEUDO_GRADIENT]
        ratio = aggregate[SQUARED_NORM] / (2 * (mean_change.square().sum() + self.epsilon))
        state.tensors["server_lr"] = ratio.clamp(min=1.0).reshape(())
        state.step(params, state.tensors["server_lr"] * mean_change)

    def round_metrics(self, state: ServerState) -> dict[str, float]:
        return {"server_lr": state.tensors["server_lr"].item()}
