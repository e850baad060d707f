"""An algorithm of your own: `--algorithm my_algorithm.ClippedFedAvg` (with this folder on PYTHONPATH).

FedAvg whose clients clip their model change to L2 norm `clip_norm` before uploading (the clipping
of DP-FedAvg, McMahan et al. 2018, without the noise), so no single client can move the global
model far; it logs the norm of each round's aggregated update.
"""

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm, train_locally
from fl_lightning.clients import ClientRound, clip_to_norm
from fl_lightning.errors import ConfigError
from fl_lightning.server_optimizers import ServerState


class ClippedFedAvg(Algorithm):
    short_name = "clipped_fedavg"  # names the runs; on the command line give the class path
    default_weighting = "uniform"  # p_i = 1 / clients per round, as in DP-FedAvg
    weighted_uploads = (PSEUDO_GRADIENT,)  # aggregated as sum_i p_i * upload_i

    def __init__(self, clip_norm: float = 1.0):
        """
        Args:
            clip_norm: largest L2 norm of a client's model change x - y.
        """
        if not clip_norm > 0:  # refused before any data is loaded, naming the setting
            raise ConfigError("algorithm.init_args.clip_norm", "a number > 0", clip_norm)
        self.clip_norm = clip_norm  # hyper-parameters only: the object is frozen once built

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        local_params = train_locally(client)  # local SGD from the global model x
        return {PSEUDO_GRADIENT: clip_to_norm(client.global_params - local_params, self.clip_norm)}

    def server_update(self, state: ServerState, params: torch.Tensor, aggregate: dict[str, torch.Tensor]) -> None:
        # What the server keeps is the run's `state` (checkpointed with it), never the algorithm's.
        state.tensors["update_norm"] = aggregate[PSEUDO_GRADIENT].norm()
        state.step(params, aggregate[PSEUDO_GRADIENT])  # x <- x - lr * mean change

    def round_metrics(self, state: ServerState) -> dict[str, float]:
        return {"update_norm": state.tensors["update_norm"].item()}
