"""Gradient statistics at the global model, and the global model's weight sizes (FedCONST, Figs. 3a,
5 and 6).

`GradientVariance` and `GSNR` draw extra mini-batches from each of the round's clients, on the
rank that trained it, and take the loss gradient at the global model x the client started from
(`ClientRound.gradient_at`). They change nothing the run depends on:
- the samples and their augmentation come from a generator of their own, seeded by (seed,
  stream, round, client) like the training streams but with a stream number of its own, so they
  are the same for any number of ranks and never advance a training stream;
- the global random state (dropout masks) is saved before and restored after (`fork_rng`);
- the forward passes read the global BatchNorm buffers and write no buffer;
- the gradient is taken at a detached x, whose values are only read.
Each client's moments are summed with its aggregation weight p_m in `on_client_end`; one
all-reduce on the measured round gives every rank the same metrics. Sums are kept in float64.
"""

from __future__ import annotations

from typing import Optional

import torch

from fl_lightning.algorithms.base import PSEUDO_GRADIENT
from fl_lightning.diagnostics.base import Diagnostic
from fl_lightning.diagnostics.local_updates import RoundSums, accumulation_dtype
from fl_lightning.errors import ConfigError

# Random streams of the diagnostics' own samples; training uses streams 0 (client sampling) and 1
# (each client's batches), see fl_lightning.clients.run.
GRADIENT_VARIANCE_STREAM = 1001
GSNR_STREAM = 1002


def gradient_moments(client, num_batches: int, batch_size: int, stream: int, dtype: torch.dtype,
                     projected: bool = False) -> Optional[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per-parameter mean and sum of squared deviations (Welford, in `dtype`) of the loss gradients
    at the client's global model x on `num_batches` mini-batches of `batch_size` samples, drawn
    without replacement from the client's data (fewer batches when it holds fewer samples), and
    how many batches that was; None when fewer than two batches fit.

    With `projected`, each gradient is first mapped by the round's constraint projection (FedCONST),
    i.e. taken as the direction local SGD steps along (weight decay aside); without a constraint
    the gradient is left as it is."""
    num_batches = min(num_batches, client.num_samples // batch_size)
    if num_batches < 2:
        return None
    generator = client.generator(stream)
    positions = torch.randperm(client.num_samples, generator=generator)[: num_batches * batch_size]
    params = client.global_params.detach()
    project = client.projection if projected else None
    mean = torch.zeros(params.numel(), dtype=dtype, device=params.device)
    squared_deviations = torch.zeros_like(mean)
    cuda_devices = [params.device] if params.device.type == "cuda" else []
    batches = client.draw_batches(list(positions.split(batch_size)), generator)
    with torch.random.fork_rng(devices=cuda_devices), torch.enable_grad():
        for count, batch in enumerate(batches, start=1):
            gradient = client.gradient_at(params, batch)
            if project is not None:
                gradient = project(gradient)
            gradient = gradient.detach().to(dtype)
            delta = gradient - mean
            mean.add_(delta / count)
            squared_deviations.add_(delta * (gradient - mean))
    return mean, squared_deviations, num_batches


def _check_sizes(name: str, num_batches: int, batch_size: int) -> None:
    if num_batches < 2:
        raise ConfigError(f"callbacks.{name}.num_batches", "an integer >= 2 (a variance needs two gradients)",
                          num_batches)
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"callbacks.{name}.batch_size", "an integer >= 1", batch_size)


class GradientVariance(RoundSums):
    """Local gradient variance (FedCONST, section 4.3.1, Figure 3a: "our method reduces gradient
    variance compared to FedAvg, thereby stabilizing local updates in environments with sparse
    data"). The paper gives no formula; measured here as the variance of a client's mini-batch
    gradients, the noise of its local SGD steps, at the global model it starts from:

        V_m = 1/(n-1) sum_b |g_m,b - gbar_m|^2,   gbar_m = 1/n sum_b g_m,b,

    over n = `num_batches` mini-batches of `batch_size` samples (default: the federation's batch
    size) drawn from client m's data (the trace of the gradient covariance, unbiased).

    Metrics: `gradient_variance` = sum_m p_m V_m / sum_m p_m, and `gradient_variance/between_clients`
    = sum_m p_m |gbar_m - gbar|^2 / sum_m p_m with gbar the weighted mean of the gbar_m (how much the
    clients' mean gradients differ, the heterogeneity part). With `projected` (default) the
    gradients are the directions after the round's constraint projection, the ones local SGD
    uses under FedCONST; without a constraint that is the plain gradient. One all-reduce of
    sum p_m gbar_m (one model-sized vector) and three numbers."""

    def __init__(self, every: int = 1, num_batches: int = 8, batch_size: Optional[int] = None,
                 projected: bool = True):
        super().__init__(every)
        _check_sizes(type(self).__name__, num_batches, batch_size)
        self.num_batches, self.batch_size, self.projected = num_batches, batch_size, projected

    def size(self, loop) -> int:
        return loop.global_model.param_layout.numel + 3

    def add(self, sums, loop, client, uploads, weight) -> None:
        batch_size = self.batch_size or loop.inputs.settings.federation.batch_size
        moments = gradient_moments(client, self.num_batches, batch_size, GRADIENT_VARIANCE_STREAM, sums.dtype,
                                   self.projected)
        if moments is None:
            return
        mean, squared_deviations, count = moments
        self.count_passes(count, count)
        sums[:-3].add_(mean, alpha=weight)
        sums[-3:] += torch.stack([weight * squared_deviations.sum() / (count - 1), weight * mean.dot(mean),
                                  torch.tensor(weight, dtype=sums.dtype, device=sums.device)])

    def metrics(self, total, loop) -> dict[str, float]:
        weighted_mean, (variance, mean_squares, weights) = total[:-3], total[-3:]
        if weights <= 0:
            return {}
        mean = weighted_mean / weights
        between = (mean_squares / weights - mean.dot(mean)).clamp_min(0)
        return {"gradient_variance": (variance / weights).item(),
                "gradient_variance/between_clients": between.item()}


class GSNR(RoundSums):
    """Gradient signal-to-noise ratio of the parameters (FedCONST, section 2.2, Equation 3, after Liu
    et al.): per parameter j, "$r_{j}=\\frac{g_{j}^{2}}{\\rho_{j}^{2}}$", the squared mean of its
    gradient over the data divided by the variance of that gradient over the data.

    The gradients are taken at the global model x, as in appendix C.3: "Figure 14a presents the sum
    of GSNR values on a client at the initial local training step of each round". Each client
    contributes `num_batches` gradients (`batch_size` 1: per-sample gradients, as in the definition;
    a larger batch gives the GSNR of mini-batch gradients, about `batch_size` times larger).
    Variances are unbiased; parameters whose gradient does not vary (variance 0, r undefined) are
    left out of the means.

    Metrics:
    - `gsnr/client_sum`, `gsnr/client_mean`: per client m, r_m,j = gbar_m,j^2 / rho_m,j^2 over its
      own samples, summed over the parameters (Figure 6: "The sum of GSNR values on a Client") or
      averaged; then averaged over the clients with weights p_m.
    - `gsnr/mean`: r_j over the round's clients' data together (the mixture sum_m p_m D_m: mean
      gbar_j = sum_m p_m gbar_m,j, variance sum_m p_m (rho_m,j^2 + gbar_m,j^2) - gbar_j^2), averaged
      over the parameters; with `per_layer`, also `gsnr/<parameter name>` per tensor.
    - Figure 5 ("Weight magnitudes and GSNR values sampled from the top 10% and bottom 10% of
      gradient update magnitudes across clients"), with `update_fraction` f > 0: the parameters are
      ranked by their update size across clients, sum_m p_m |Delta w_m,j|; `gsnr/top_update` and
      `gsnr/bottom_update` average r_j over the top and bottom fraction f, `weight_abs/top_update`
      and `weight_abs/bottom_update` the size |x_j| of their weights in the global model the
      clients started from.
    One all-reduce of three model-sized vectors (four with `update_fraction`) and three numbers.
    Expensive: `num_batches` extra forward/backward passes per client on the measured rounds.
    """

    def __init__(self, every: int = 1, num_batches: int = 32, batch_size: int = 1, projected: bool = False,
                 per_layer: bool = False, update_fraction: float = 0.1):
        super().__init__(every)
        _check_sizes(type(self).__name__, num_batches, batch_size)
        if not 0 <= update_fraction <= 0.5:
            raise ConfigError(f"callbacks.{type(self).__name__}.update_fraction", "a fraction in [0, 0.5]",
                              update_fraction)
        self.num_batches, self.batch_size, self.projected = num_batches, batch_size, projected
        self.per_layer, self.update_fraction = per_layer, update_fraction
        self._start_params: Optional[torch.Tensor] = None

    def on_fit_start(self, engine, loop) -> None:
        if self.batch_size == 1 and loop.global_model.buffer_layout.numel > 0:
            raise ConfigError(f"callbacks.{type(self).__name__}.batch_size",
                              "an integer >= 2 for a model with BatchNorm (it normalises by batch statistics)", 1)

    def on_round_start(self, engine, loop, round_index: int) -> None:
        super().on_round_start(engine, loop, round_index)
        if self.due(loop, round_index + 1) and self.update_fraction > 0:
            self._start_params = loop.global_model.params.detach().clone()

    def _vectors(self) -> int:
        return 4 if self.update_fraction > 0 else 3

    def size(self, loop) -> int:
        return self._vectors() * loop.global_model.param_layout.numel + 3

    def add(self, sums, loop, client, uploads, weight) -> None:
        moments = gradient_moments(client, self.num_batches, self.batch_size, GSNR_STREAM, sums.dtype, self.projected)
        if moments is None:
            return
        mean, squared_deviations, count = moments
        self.count_passes(count, count)
        variance = squared_deviations / (count - 1)
        vectors = sums[:-3].view(self._vectors(), -1)
        vectors[0].add_(mean, alpha=weight)
        vectors[1].add_(mean * mean, alpha=weight)
        vectors[2].add_(variance, alpha=weight)
        if self.update_fraction > 0:
            vectors[3].add_(uploads[PSEUDO_GRADIENT].detach().to(sums.dtype).abs(), alpha=weight)
        defined = variance > 0
        ratios = mean[defined] ** 2 / variance[defined]
        client_mean = ratios.mean() if ratios.numel() else ratios.new_zeros(())
        sums[-3:] += weight * torch.stack([ratios.sum(), client_mean, torch.ones_like(client_mean)])

    def metrics(self, total, loop) -> dict[str, float]:
        vectors, (client_sum, client_mean, weights) = total[:-3].view(self._vectors(), -1), total[-3:]
        start_params, self._start_params = self._start_params, None
        if weights <= 0:
            return {}
        mean, mean_squares, within = vectors[0] / weights, vectors[1] / weights, vectors[2] / weights
        variance = within + (mean_squares - mean * mean).clamp_min(0)
        defined = variance > 0
        ratios = torch.where(defined, mean * mean / torch.where(defined, variance, 1.0), float("nan"))
        out = {"gsnr/mean": ratios.nanmean().item(), "gsnr/client_sum": (client_sum / weights).item(),
               "gsnr/client_mean": (client_mean / weights).item()}
        if self.per_layer:
            layout = loop.global_model.param_layout
            out.update({f"gsnr/{name}": view.nanmean().item() for name, view in layout.views(ratios).items()})
        if self.update_fraction > 0:
            update_size = vectors[3]
            count = max(1, int(round(self.update_fraction * update_size.numel())))
            for group, largest in (("top_update", True), ("bottom_update", False)):
                chosen = update_size.topk(count, largest=largest).indices
                out[f"gsnr/{group}"] = ratios[chosen].nanmean().item()
                if start_params is not None:
                    out[f"weight_abs/{group}"] = start_params[chosen].abs().to(total.dtype).mean().item()
        return out


class WeightNorms(Diagnostic):
    """The L2 (Frobenius) norm of each weight tensor of the global model after the round's server
    step, `weight_norm/<parameter name>` (names as in the checkpoint's model): FedCONST takes the
    global weights' sizes as the proxy of feature strength (Conjecture 1, Figure 5), and its
    orthogonality constraint makes them grow round by round. Only tensors with two or more
    dimensions (conv and linear weights) unless `all_parameters`. Every rank holds the same
    global model, so no reduction is needed."""

    def __init__(self, every: int = 1, all_parameters: bool = False):
        super().__init__(every)
        self.all_parameters = all_parameters

    def measured(self, engine, loop, metrics: dict) -> None:
        views = {name: view for name, view in loop.global_model.param_layout.views(loop.global_model.params).items()
                 if self.all_parameters or view.dim() >= 2}
        if not views:
            return
        dtype = accumulation_dtype(loop.global_model.params.device)
        norms = torch.stack([view.detach().to(dtype).norm() for view in views.values()]).tolist()
        metrics.update({f"weight_norm/{name}": norm for name, norm in zip(views, norms)})
