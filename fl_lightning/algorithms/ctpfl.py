"""CTP-FL (Common-Trajectory Predictive FL, Algorithm 1 of the paper).

Every client evaluates one mini-batch gradient at each of K shared points
z_k = x - t_k v on the line through the global model x along the previous server direction v,
t_k = k h / (K - 1) (t_0 = 0 when K = 1), and uploads their mean u_i. The server steps on the
aggregate sum_i p_i u_i with its optimizer (gamma = its lr): x <- x - gamma v with v the aggregate
under plain SGD, as in the paper. No local model is trained.

The direction is the step the server took, v = (x_previous - x) / gamma: the paper's own identity
(v^r = (x^{r-1} - x^r) / gamma), which under plain SGD is the aggregate itself (and is kept as it,
exactly). With server momentum or an adaptive server optimizer (FedAdam, FedYogi, FedAdagrad) the
step is not the aggregate, and the query points follow the trajectory the model actually moves on:
with h = gamma the last point is one server step ahead of x.

h = 0 queries every gradient at x: one SGD step per round on S x K x B samples (synchronised
mini-batch SGD, FedSGD with a large batch). A round is then one step of the global model, where a
round of FedAvg is K local steps of each client: equal rounds are not equal progress.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm
from fl_lightning.algorithms.costs import Cost
from fl_lightning.clients import ClientRound, clip_to_norm
from fl_lightning.clients.run import planned_steps
from fl_lightning.config import FederationArgs
from fl_lightning.errors import ConfigError
from fl_lightning.server_optimizers import ServerSGD, ServerState


class CTPFL(Algorithm):
    short_name = "ctpfl"
    trains_locally = False
    default_weighting = "uniform"
    # K gradient evaluations (one per query point), u_i up, x down: v = (x_previous - x) / gamma is rebuilt.
    cost = Cost(rebuilt_down=("direction",))

    def __init__(self, span: Optional[float] = None, weight_decay: float = 0.0, clip_norm: Optional[float] = None):
        """
        Args:
            span: prediction span h >= 0; None uses h = gamma, the server lr (Theorem 4.3).
            weight_decay: adds weight_decay * z_k to each gradient.
            clip_norm: clips each client's u_i to this L2 norm.
        """
        if span is not None and span < 0:
            raise ConfigError("algorithm.init_args.span", "a value >= 0 (or null for h = server lr)", span)
        if weight_decay < 0:
            raise ConfigError("algorithm.init_args.weight_decay", "a value >= 0", weight_decay)
        if clip_norm is not None and clip_norm <= 0:
            raise ConfigError("algorithm.init_args.clip_norm", "a value > 0 (or null)", clip_norm)
        self.span = span
        self.weight_decay = weight_decay
        self.clip_norm = clip_norm

    def check_federation(self, federation: FederationArgs, client_sizes: np.ndarray) -> None:
        # local_epochs gives each client K_i = E * ceil(n_i / B) steps, and stragglers cut them: unequal
        # counts would give the clients different query points, and shared points are the method's premise.
        if federation.stragglers is not None:
            raise ConfigError("federation.stragglers", "null for CTP-FL, whose clients must each query the same K "
                              "points (unequal local steps give them different query points)",
                              federation.stragglers.init_args)
        if federation.local_epochs is None:
            return
        steps = {planned_steps(int(n), federation) for n in np.unique(client_sizes)}
        if len(steps) > 1:
            raise ConfigError(
                "federation.local_epochs",
                f"null for CTP-FL on these clients, whose sizes give from {min(steps)} to {max(steps)} local steps "
                "while CTP-FL's clients share one set of K query points (set federation.local_steps: K)",
                federation.local_epochs,
            )

    def effective_span(self, server: ServerState) -> float:
        """h: `span`, or the lr of the server optimizer the run steps with."""
        return server.optimizer.lr if self.span is None else self.span

    def initial_server_state(self, num_params: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"direction": torch.zeros(num_params, device=device)}

    def query_offsets(self, num_steps: int, span: float) -> list[float]:
        if num_steps == 1:
            return [0.0]
        return [k * span / (num_steps - 1) for k in range(num_steps)]

    @property
    def fuses_clients(self) -> bool:
        # u_i is affine in the client's gradients at points all clients share; clipping is not.
        return self.clip_norm is None

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        """The query points are the same for every client, so in the grouped path (`compute.client_path`)
        the clients of a rank evaluate each of them in one pass over their concatenated batches,
        each normalising with its own batch statistics; fused (`fuses_clients`), that pass has one
        backward, of the weighted sum of their losses."""
        direction = client.server.tensors["direction"]
        gradient_sum = 0.0
        offsets = self.query_offsets(client.num_steps, self.effective_span(client.server))
        for offset, batch in zip(offsets, client.batches()):
            query = client.global_params - offset * direction
            _, gradient = client.loss_and_grad(query, batch)
            gradient_sum = gradient_sum + self.with_weight_decay(gradient, query)
        return {PSEUDO_GRADIENT: clip_to_norm(gradient_sum / client.num_steps, self.clip_norm)}

    def with_weight_decay(self, gradient: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        return gradient + self.weight_decay * query if self.weight_decay else gradient

    def server_update(self, state: ServerState, params: torch.Tensor, aggregate: dict[str, torch.Tensor]) -> None:
        optimizer = state.optimizer
        if isinstance(optimizer, ServerSGD) and not optimizer.momentum:  # the step is gamma times the aggregate
            state.tensors["direction"] = aggregate[PSEUDO_GRADIENT].clone()
            state.step(params, state.tensors["direction"])
            return
        previous = params.clone()
        state.step(params, aggregate[PSEUDO_GRADIENT])
        state.tensors["direction"] = (previous - params) / optimizer.lr

    def round_metrics(self, state: ServerState) -> dict[str, float]:
        norm, span = state.tensors["direction"].norm().item(), self.effective_span(state)
        return {"direction_norm": norm, "span": span, "displacement": span * norm}
