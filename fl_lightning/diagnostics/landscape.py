"""The loss landscape of the global model: the extreme Hessian eigenvalues and the Hessian trace.

FedCONST (Kim, Kim, Shyn, Kim, "Federated Learning for Feature Generalization with Convex
Constraints", arXiv:2606.14416: section 4.3.2 and Tables 2-3) reads the global model's Hessian for how
convex the landscape is: C_convex = |lambda_max / lambda_min| with lambda_min the smallest
(most negative) eigenvalue, and the trace H_trace (a negative trace points to a saddle). Appendix
C.2 (Table 4) also reports lambda_max alone, the usual sharpness measure.

All of it comes from Hessian-vector products of the global model's loss on a fixed subset of a
split, never from the Hessian itself: Lanczos (or power iteration) for the two extreme eigenvalues
and Hutchinson's estimator for the trace. The loss is the module's own (`training_step`) through a
functional call in eval mode, so BatchNorm normalises with the running statistics and no buffer
changes; the parameters are the flat global model, read and never written. Every random number
(the subset, the start vector, the probes) comes from the diagnostic's own generators, seeded by
its `seed`, so the same subset and probes are used at every measured round and training's random
streams are not touched.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Callable, Literal

import torch

from fl_lightning.clients.run import seeded_generator
from fl_lightning.diagnostics.base import HVP_PASSES, Diagnostic
from fl_lightning.errors import ConfigError

HVP = Callable[[torch.Tensor], torch.Tensor]

# Streams of the diagnostic's generators (seeded_generator(seed, stream)).
SUBSET_STREAM = 0
START_STREAM = 1
PROBE_STREAM = 2

METRICS = ("hessian/lambda_max", "hessian/lambda_min", "hessian/convexity", "hessian/trace",
           "hessian/trace_stderr", "hessian/loss", "hessian/seconds")


def lanczos_extremes(hvp: HVP, dim: int, iterations: int, generator: torch.Generator, device: torch.device
                     ) -> tuple[float, float]:
    """(largest, smallest) eigenvalue of the symmetric operator `hvp` on R^dim: the extreme Ritz
    values after `iterations` Lanczos steps with full reorthogonalisation (exact once
    iterations >= dim). Keeps the Krylov basis: iterations x dim floats."""
    steps = min(iterations, dim)
    basis = torch.zeros(steps, dim, device=device)
    vector = torch.randn(dim, generator=generator).to(device)
    basis[0] = vector / vector.norm()
    alphas, betas = [], []
    for j in range(steps):
        w = hvp(basis[j])
        alpha = torch.dot(w, basis[j])
        alphas.append(alpha.item())
        # Full reorthogonalisation, twice ("twice is enough"): plain three-term Lanczos loses
        # orthogonality in float32 within a few steps and then repeats Ritz values.
        for _ in range(2):
            w = w - basis[: j + 1].T @ (basis[: j + 1] @ w)
        beta = w.norm().item()
        if j + 1 == steps or beta <= 1e-6 * max(abs(a) for a in alphas) + 1e-30:
            break  # an invariant subspace: the Ritz values are exact eigenvalues
        betas.append(beta)
        basis[j + 1] = w / beta
    tridiagonal = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas[: len(alphas) - 1], dtype=torch.float64)
        tridiagonal += torch.diag(off, 1) + torch.diag(off, -1)
    ritz = torch.linalg.eigvalsh(tridiagonal)
    return ritz[-1].item(), ritz[0].item()


def power_extremes(hvp: HVP, dim: int, iterations: int, generator: torch.Generator, device: torch.device
                   ) -> tuple[float, float]:
    """(largest, smallest) eigenvalue by power iteration with O(dim) memory: `iterations` steps
    give the eigenvalue of largest magnitude mu, `iterations` more on H - mu I the one at the other
    end of the spectrum (mu + the dominant eigenvalue of the shifted operator). Each estimate is
    a Rayleigh quotient; convergence depends on the eigenvalue gaps, unlike Lanczos's."""
    def dominant(operator: HVP) -> float:
        vector = torch.randn(dim, generator=generator).to(device)
        vector = vector / vector.norm()
        value = 0.0
        for _ in range(iterations):
            image = operator(vector)
            value = torch.dot(image, vector).item()
            norm = image.norm()
            if norm.item() == 0.0:
                break
            vector = image / norm
        return value

    mu = dominant(hvp)
    other = mu + dominant(lambda v: hvp(v) - mu * v)
    return max(mu, other), min(mu, other)


def hutchinson_trace(hvp: HVP, dim: int, probes: int, generator: torch.Generator, device: torch.device
                     ) -> tuple[float, float]:
    """Hutchinson's estimate of tr(H): the mean of z^T H z over `probes` Rademacher vectors z, and
    its standard error (0 for one probe)."""
    samples = []
    for _ in range(probes):
        z = (torch.randint(0, 2, (dim,), generator=generator) * 2 - 1).float().to(device)
        samples.append(torch.dot(z, hvp(z)).item())
    values = torch.tensor(samples, dtype=torch.float64)
    stderr = values.std().item() / math.sqrt(probes) if probes > 1 else 0.0
    return values.mean().item(), stderr


def hessian_vector_product(loss: Callable[[torch.Tensor], torch.Tensor], params: torch.Tensor,
                           how: Literal["jvp", "double_backward"]) -> HVP:
    """v -> H v for the Hessian of `loss` at flat `params`: forward-over-reverse (`torch.func.jvp`
    of `torch.func.grad`) or double backward (for layers without forward-mode rules)."""
    if how == "jvp":
        gradient = torch.func.grad(loss)

        def forward_over_reverse(v: torch.Tensor) -> torch.Tensor:
            with warnings.catch_warnings():
                # torch registers its forward-mode decompositions with torch.jit.script on first use
                # and warns that it is deprecated: torch's own business, not the run's.
                warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated", category=FutureWarning)
                return torch.func.jvp(gradient, (params,), (v,))[1].detach()

        return forward_over_reverse

    def double_backward(v: torch.Tensor) -> torch.Tensor:
        point = params.detach().requires_grad_(True)
        (gradient,) = torch.autograd.grad(loss(point), point, create_graph=True)
        (product,) = torch.autograd.grad(gradient, point, v)
        return product.detach()

    return double_backward


class Landscape(Diagnostic):
    """Adds to the round's metrics, every `every` rounds, the Hessian of the global model's loss on
    a fixed subset: `hessian/lambda_max`, `hessian/lambda_min` (the smallest, usually negative),
    `hessian/convexity` (|lambda_max / lambda_min|, FedCONST's C_convex), `hessian/trace`
    (Hutchinson) and `hessian/trace_stderr`, `hessian/loss` (the loss on the subset) and
    `hessian/seconds` (the time it took). Measured after the round's server step, on rank 0; one
    sum over ranks gives every rank the values."""

    safe_to_change = (*Diagnostic.safe_to_change, "batch_size")  # memory only, not the values

    def __init__(self, every: int = 10, split: Literal["train", "test"] = "train", subset_size: int = 1000,
                 batch_size: int = 1000, method: Literal["lanczos", "power"] = "lanczos", iterations: int = 20,
                 probes: int = 10, hvp: Literal["jvp", "double_backward"] = "jvp", seed: int = 0):
        """
        Args:
            every: measure every this many rounds (and after the last).
            split: the loss on the training data the clients hold ("train": the union of their
                samples, un-augmented) or on the test split ("test").
            subset_size: samples in the fixed subset (all of them when the split is smaller).
            batch_size: samples per forward pass (memory only; the result does not depend on it).
            method: "lanczos" (both extremes from one Krylov space, iterations x parameters floats
                of memory) or "power" (power iteration, then on the shifted H - mu I; O(parameters)).
            iterations: Hessian-vector products for the eigenvalues (Lanczos), or per end (power).
            probes: Rademacher probes for the trace (one Hessian-vector product each).
            hvp: "jvp" (forward-over-reverse) or "double_backward".
            seed: seeds the subset, the start vector and the probes (the same at every round).
        """
        super().__init__(every)
        for name, value in (("subset_size", subset_size), ("batch_size", batch_size), ("iterations", iterations),
                            ("probes", probes)):
            if value < 1:
                raise ConfigError(f"callbacks.Landscape.{name}", "an integer >= 1", value)
        self.split, self.subset_size, self.batch_size = split, subset_size, batch_size
        self.method, self.iterations, self.probes, self.hvp, self.seed = method, iterations, probes, hvp, seed

    def subset(self, loop) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed subset's normalised inputs and labels on the loop's device (never augmented)."""
        if self.split == "train":
            pool = loop.trainer.training_pool()
        else:
            pool = torch.arange(loop.evaluation.test_size)
        chosen = pool[torch.randperm(len(pool), generator=seeded_generator(self.seed, SUBSET_STREAM))[
            : self.subset_size]].sort().values
        if self.split == "train":
            return loop.trainer.training_batch(chosen)
        return loop.evaluation.test_batch(chosen)

    def measure(self, loop) -> dict[str, float]:
        """The metrics for the loop's global model now (this rank alone)."""
        started = time.perf_counter()
        trainer, params = loop.trainer, loop.global_model.params.detach()
        buffers = loop.global_model.buffers.clone()  # eval mode reads them; a copy all the same
        inputs, labels = self.subset(loop)
        chunks = list(zip(inputs.split(self.batch_size), labels.split(self.batch_size)))
        total = len(labels)

        def chunk_loss(batch) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda p: trainer.eval_loss(p, buffers, batch)

        products = [(len(batch[1]) / total, hessian_vector_product(chunk_loss(batch), params, self.hvp))
                    for batch in chunks]

        def hvp(v: torch.Tensor) -> torch.Tensor:
            self.count_passes(HVP_PASSES * len(products), HVP_PASSES * len(products))
            return sum(weight * product(v) for weight, product in products)

        was_training = loop.module.training
        device = params.device
        try:
            # The model's forward in eval mode draws no random numbers; the fork is a guard that
            # training's global stream is the same after this as before, whatever the model does.
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                with torch.no_grad():
                    loss = sum(len(batch[1]) / total * chunk_loss(batch)(params).float() for batch in chunks)
                self.count_passes(len(chunks), 0)
                extremes = lanczos_extremes if self.method == "lanczos" else power_extremes
                largest, smallest = extremes(hvp, params.numel(), self.iterations,
                                             seeded_generator(self.seed, START_STREAM), device)
                trace, stderr = hutchinson_trace(hvp, params.numel(), self.probes,
                                                 seeded_generator(self.seed, PROBE_STREAM), device)
        finally:
            loop.module.train(was_training)
        return {
            "hessian/lambda_max": largest,
            "hessian/lambda_min": smallest,
            "hessian/convexity": abs(largest / smallest) if smallest != 0 else math.inf,
            "hessian/trace": trace,
            "hessian/trace_stderr": stderr,
            "hessian/loss": float(loss),
            "hessian/seconds": time.perf_counter() - started,
        }

    def measured(self, engine, loop, metrics: dict) -> None:
        values = torch.zeros(len(METRICS), dtype=torch.float64)
        if engine.global_rank == 0:
            measured = self.measure(loop)
            values = torch.tensor([measured[name] for name in METRICS], dtype=torch.float64)
        # Rank 0 measures, the others add zeros: one reduction gives every rank the same row.
        summed = self.reduced(engine, values.to(engine.device)).cpu()
        metrics.update({name: value.item() for name, value in zip(METRICS, summed)})
