"""How the clients' updates of a round relate to each other (FedCONST, section 4.3).

Each diagnostic here looks only at what the clients upload: Delta w_m, client m's pseudo-gradient
upload. For the local-update methods that is x - y_m (`PSEUDO_GRADIENT`), the negative of the
paper's Delta w_m = y_m - x; every quantity below is a norm, a ratio of squared norms or a cosine
taken over all clients at once, so the sign does not change it. (For CTP-FL the upload is the
client's mean gradient u_i, not a model change; the same statistics then describe those.)

p_m is the round's aggregation weight of client m (`weighting`: |D_m| / sum of the round's |D_j|
for `num_samples`, 1/S for `uniform`), so sum_m p_m Delta w_m is exactly the aggregated update.

On its rounds a diagnostic adds each client's share into one local vector in `on_client_end`, sums
that vector over the ranks once in `on_round_end` (a single all-reduce), and adds its metrics to
the round's row. On the other rounds it does nothing. Sums are kept in float64.
"""

from __future__ import annotations

from typing import Optional

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT
from fl_lightning.diagnostics.base import Diagnostic


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 for the sums, except where the device has none (Apple MPS)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


class RoundSums(Diagnostic):
    """A diagnostic that sums per-client quantities into one flat vector on its rounds and reduces
    it once: subclasses give the vector's `size`, `add` one client's share, and turn the sum over
    all ranks into `metrics`."""

    def __init__(self, every: int = 1):
        super().__init__(every)
        self._sums: Optional[torch.Tensor] = None

    def size(self, loop) -> int:
        raise NotImplementedError

    def add(self, sums: torch.Tensor, loop, client, uploads: dict, weight: float) -> None:
        raise NotImplementedError

    def metrics(self, total: torch.Tensor, loop) -> dict[str, float]:
        raise NotImplementedError

    def _local_sums(self, engine, loop) -> torch.Tensor:
        if self._sums is None:
            self._sums = torch.zeros(self.size(loop), dtype=accumulation_dtype(engine.device), device=engine.device)
        return self._sums

    def on_round_start(self, engine, loop, round_index: int) -> None:
        super().on_round_start(engine, loop, round_index)
        if self.due(loop, round_index + 1):
            self._sums = None  # nothing left over from a round that failed before its end

    def on_client_end(self, engine, loop, client, uploads: dict, weight: float) -> None:
        if self.due(loop, client.round + 1):
            self.add(self._local_sums(engine, loop), loop, client, self.read_uploads(loop, client, uploads), weight)

    def measured(self, engine, loop, metrics: dict) -> None:
        # A rank that trained no client this round still joins the reduction, with zeros.
        local = self._local_sums(engine, loop)
        self._sums = None
        metrics.update(self.metrics(self.reduced(engine, local), loop))


def _upload(uploads: dict, dtype: torch.dtype) -> torch.Tensor:
    return uploads[PSEUDO_GRADIENT].detach().to(dtype)


def _num_params(loop) -> int:
    return loop.global_model.param_layout.numel


class ClientDrift(RoundSums):
    """Client drift: how far each client moved from the global model, |y_m - x|_2 (the norm of its
    pseudo-gradient upload).

    Metrics: `client_drift/mean`, the mean of |Delta w_m| weighted by the aggregation weights
    (sum_m p_m |Delta w_m| / sum_m p_m), and `client_drift/max`, the largest |Delta w_m| of the
    round. Each client writes its norm and weight into its own slot of a vector as long as the
    number of clients, so the maximum over all ranks comes out of the same sum."""

    def size(self, loop) -> int:
        return 2 * loop.inputs.settings.federation.num_clients

    def add(self, sums, loop, client, uploads, weight) -> None:
        num_clients = loop.inputs.settings.federation.num_clients
        sums[client.client_id] = _upload(uploads, sums.dtype).norm()
        sums[num_clients + client.client_id] = weight

    def metrics(self, total, loop) -> dict[str, float]:
        norms, weights = total.view(2, -1)
        return {"client_drift/mean": ((weights * norms).sum() / weights.sum()).item(),
                "client_drift/max": norms.max().item()}


class DriftDiversity(RoundSums):
    """Drift diversity, as FedCONST (section 4.3.1, after Li et al., 2023) defines it: "our method
    enhances drift diversity, defined as
    $\\frac{\\sum_{m\\in M}\\frac{|D_{m}|}{|D|}\\left\\|\\bm{\\Delta w}_{m}^{k}\\right\\|_{2}^{2}}
    {\\left\\|\\bm{\\Delta w}^{k+1}\\right\\|_{2}^{2}}$".

    Here: `drift_diversity` = sum_m p_m |Delta w_m|^2 / |Delta w|^2 with Delta w = sum_m p_m Delta w_m,
    the round's aggregated update (p_m = |D_m|/|D| over the round's clients with `weighting:
    num_samples`). By Jensen's inequality it is >= 1, and 1 only when all clients moved alike.
    One all-reduce of sum_m p_m Delta w_m (one model-sized vector) and sum_m p_m |Delta w_m|^2."""

    def size(self, loop) -> int:
        return _num_params(loop) + 1

    def add(self, sums, loop, client, uploads, weight) -> None:
        update = _upload(uploads, sums.dtype)
        sums[:-1].add_(update, alpha=weight)
        sums[-1] += weight * update.dot(update)

    def metrics(self, total, loop) -> dict[str, float]:
        mean_update, weighted_squares = total[:-1], total[-1]
        return {"drift_diversity": (weighted_squares / mean_update.dot(mean_update)).item()}


class ClientConsistency(RoundSums):
    """Client consistency, as FedCONST (section 4.3.2) defines it: "This consistency is defined as
    $\\sum_{m\\in M}\\frac{\\left|D_{m}\\right|}{\\left|D\\right|}\\left\\|\\Delta\\bm{w}_{m}^{k}\\right\\|_{2}^{2}$,
    where lower values indicate that client updates remain proportionally aligned, preventing
    excessive deviations in heterogeneous data environments."

    Implemented exactly so, with the round's aggregation weights for |D_m|/|D|:
    `client_consistency` = sum_m p_m |Delta w_m|^2 (not normalised; the numerator of drift
    diversity). One all-reduce of a single number."""

    def size(self, loop) -> int:
        return 1

    def add(self, sums, loop, client, uploads, weight) -> None:
        update = _upload(uploads, sums.dtype)
        sums[0] += weight * update.dot(update)

    def metrics(self, total, loop) -> dict[str, float]:
        return {"client_consistency": total[0].item()}


class UpdateCosine(RoundSums):
    """Cosine similarity of client updates (FedCONST, appendix C.3, Figure 15): the mean over all
    pairs of the round's clients (on any rank) of cos(Delta w_i, Delta w_j), unweighted.

    With unit vectors u_m = Delta w_m / |Delta w_m| of S clients, |sum_m u_m|^2 = S + 2 sum_{i<j} cos_ij,
    so `update_cosine` = (|sum_m u_m|^2 - S) / (S (S - 1)) needs only the sum of the unit vectors and S
    (one all-reduce), never the vectors themselves. Clients with a zero update have no direction and
    are left out; with fewer than two clients there is no pair and no metric."""

    def size(self, loop) -> int:
        return _num_params(loop) + 1

    def add(self, sums, loop, client, uploads, weight) -> None:
        update = _upload(uploads, sums.dtype)
        norm = update.norm()
        if norm > 0:
            sums[:-1].add_(update / norm)
            sums[-1] += 1

    def metrics(self, total, loop) -> dict[str, float]:
        unit_sum, count = total[:-1], total[-1].item()
        if count < 2:
            return {}
        return {"update_cosine": ((unit_sum.dot(unit_sum) - count) / (count * (count - 1))).item()}
