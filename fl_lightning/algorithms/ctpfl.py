"""CTP-FL (Common-Trajectory Predictive FL, Algorithm 1 of the paper).

Every client evaluates one mini-batch gradient at each of K shared points
z_k = x - t_k v on the line through the global model x along the previous server direction v,
t_k = k h / (K - 1) (t_0 = 0 when K = 1), and uploads their mean u_i. The server sets
v <- sum_i p_i u_i and steps x <- x - gamma v (the server optimizer; gamma = its lr). No local
model is trained. h = 0 is synchronised mini-batch SGD.
"""

from __future__ import annotations

from typing import Optional

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm
from fl_lightning.client import ClientRun
from fl_lightning.config import ConfigError


class CTPFL(Algorithm):
    short_name = "ctpfl"
    trains_locally = False
    default_weighting = "uniform"

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

    @property
    def effective_span(self) -> float:
        return self.server_optimizer.lr if self.span is None else self.span

    def initial_server_state(self, num_params: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"direction": torch.zeros(num_params, device=device)}

    def query_offsets(self, num_steps: int) -> list[float]:
        if num_steps == 1:
            return [0.0]
        return [k * self.effective_span / (num_steps - 1) for k in range(num_steps)]

    def client_update(self, client: ClientRun) -> dict[str, torch.Tensor]:
        direction = self.server_state["direction"]
        mean_gradient = torch.zeros_like(client.global_params)
        for offset, batch in zip(self.query_offsets(client.num_steps), client.batches()):
            query = client.global_params - offset * direction
            _, gradient = client.loss_and_grad(query, batch)
            if self.weight_decay:
                gradient = gradient + self.weight_decay * query
            mean_gradient += gradient
        mean_gradient /= client.num_steps
        if self.clip_norm is not None:
            mean_gradient *= min(1.0, self.clip_norm / (mean_gradient.norm().item() + 1e-12))
        return {PSEUDO_GRADIENT: mean_gradient}

    def server_update(self, params: torch.Tensor, aggregate: dict[str, torch.Tensor]) -> None:
        self.server_state["direction"] = aggregate[PSEUDO_GRADIENT].clone()
        self.server_optimizer.step(params, self.server_state["direction"])

    def round_metrics(self) -> dict[str, float]:
        norm = self.server_state["direction"].norm().item()
        return {"direction_norm": norm, "span": self.effective_span, "displacement": self.effective_span * norm}
