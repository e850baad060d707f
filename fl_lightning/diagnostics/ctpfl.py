"""CTP-FL's displacement bias, measured (Junkang Liu, "CTP-FL: Common-Trajectory Gradient Prediction for
Federated Learning", arXiv:2609.35130: section 3.4, eqs. 12-14).

Under full participation CTP-FL's direction is an unbiased estimate of the path-averaged gradient,
E[v^{r+1} | F_r] = H^r = (1/K) sum_k grad F(z_k^r) (eq. 12), not of grad F(x^r); the difference,
the displacement bias H^r - grad F(x^r), is bounded by L h |v^r| / 2 (eq. 13) and equals
-(h/2) H v^r on a quadratic with Hessian H (eq. 14).

`DisplacementBias` estimates it on the clients' own mini-batches: on a measured round each client
also takes its gradient at x^r (the round's global model) on exactly the K batches it used at the
query points z_k, and these are averaged with the uploads' weights into g(x^r). Because both
sides see the same samples, the mini-batch noise common to both cancels and
v^{r+1} - g(x^r) = sum_i p_i (1/K) sum_k [g_i(z_k; B_ik) - g_i(x^r; B_ik)] is the displacement
bias on those batches, with far less noise than a comparison against a held-out batch.

|v| and h |v| are CTP-FL's own round metrics (`direction_norm`, `displacement`), logged every round:
the row of round r holds v^{r+1}, the direction of round r + 1's query points.
"""

from __future__ import annotations

import time

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT
from fl_lightning.algorithms.ctpfl import CTPFL
from fl_lightning.clients import ClientRound
from fl_lightning.diagnostics.base import Diagnostic
from fl_lightning.errors import ConfigError


def gradient_at_global_model(client: ClientRound, algorithm: CTPFL) -> torch.Tensor:
    """(1/K) sum_k g_i(x; B_ik): the client's gradient at the global model x on each batch it used
    at the query points, computed as CTP-FL computes its (training mode, so BatchNorm normalises
    with each batch's statistics, from the global buffers; the same weight decay)."""
    params = client.global_params
    total = torch.zeros_like(params)
    for batch in client.batches():
        total += algorithm.with_weight_decay(client.gradient_at(params, batch), params)
    return total / client.num_steps


class DisplacementBias(Diagnostic):
    """Adds to the round's metrics, every `every` rounds of a CTP-FL run, with g = g(x^r) the
    clients' gradient at the round's global model on their own batches, averaged like the uploads:

    - `ctpfl/bias`: |v^{r+1} - g|, the displacement bias |H^r - grad F(x^r)| on those batches;
    - `ctpfl/relative_bias`: ctpfl/bias / |g|;
    - `ctpfl/client_bias`: sum_i p_i |u_i - g_i|, the clients' own biases before averaging;
    - `ctpfl/cosine`: the cosine between v^{r+1} and g;
    - `ctpfl/gradient_norm`: |g|;
    - `ctpfl/bias_curvature`: 2 ctpfl/bias / (h |v^r|), a lower bound on the smoothness constant L
      of eq. 13 along the path (|H v| / |v| on a quadratic); absent while h |v^r| = 0;
    - `ctpfl/seconds`: this rank's time for the extra gradients (K per client, as many again as
      the round's own; twice that where the clients were fused, whose own uploads u_i are then
      computed too).

    Each rank sums its clients' parts; one sum over ranks on measured rounds aggregates them.
    """

    def __init__(self, every: int = 1):
        """
        Args:
            every: measure every this many rounds (and after the last).
        """
        super().__init__(every)
        self._measuring = False

    def on_fit_start(self, engine, loop) -> None:
        if not isinstance(loop.algorithm, CTPFL):
            raise ConfigError("callbacks.DisplacementBias", "a CTP-FL run (algorithm ctpfl)",
                              type(loop.algorithm).__name__)

    def on_round_start(self, engine, loop, round_index: int) -> None:
        super().on_round_start(engine, loop, round_index)
        self._measuring = self.due(loop, round_index + 1)
        if not self._measuring:
            return
        params = loop.global_model.params
        self._gradient_sum = torch.zeros_like(params)  # sum_i p_i g_i on this rank
        self._client_bias_sum = 0.0
        self._seconds = 0.0
        self._previous_direction_norm = loop.server_state.tensors["direction"].norm().item()  # |v^r|

    def on_client_end(self, engine, loop, client, uploads: dict, weight: float) -> None:
        if not self._measuring:
            return
        started = time.perf_counter()
        device = client.global_params.device
        # Guard: training's global random stream is the same afterwards (a model with dropout
        # would draw from it in this extra training-mode pass).
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            gradient = gradient_at_global_model(client, loop.algorithm)
        self.count_passes(client.num_steps, client.num_steps)
        self._gradient_sum.add_(gradient, alpha=weight)
        upload = self.read_uploads(loop, client, uploads)[PSEUDO_GRADIENT]
        self._client_bias_sum += weight * (upload - gradient).norm().item()
        self._seconds += time.perf_counter() - started

    def measured(self, engine, loop, metrics: dict) -> None:
        self._measuring = False
        started = time.perf_counter()
        reduced = self.reduced(engine, torch.cat([
            self._gradient_sum, torch.tensor([self._client_bias_sum], device=self._gradient_sum.device)]))
        gradient, client_bias = reduced[:-1], reduced[-1].item()
        self.gradient = gradient  # g(x^r), kept for inspection until the next measured round
        direction = loop.server_state.tensors["direction"]  # v^{r+1} = sum_i p_i u_i
        bias = (direction - gradient).norm().item()
        gradient_norm = gradient.norm().item()
        cosine = torch.nn.functional.cosine_similarity(direction, gradient, dim=0, eps=1e-30).item()
        metrics.update({"ctpfl/bias": bias,
                        "ctpfl/relative_bias": bias / gradient_norm if gradient_norm > 0 else float("nan"),
                        "ctpfl/client_bias": client_bias,
                        "ctpfl/cosine": cosine,
                        "ctpfl/gradient_norm": gradient_norm})
        displacement = loop.algorithm.effective_span(loop.server_state) * self._previous_direction_norm
        if displacement > 0:
            metrics["ctpfl/bias_curvature"] = 2 * bias / displacement
        metrics["ctpfl/seconds"] = self._seconds + time.perf_counter() - started
