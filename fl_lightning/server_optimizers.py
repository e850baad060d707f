"""The server's step on the aggregated pseudo-gradient, one swappable component.

Every algorithm hands the server a pseudo-gradient g (for FedAvg g = sum_i p_i (x - y_i), for
CTP-FL g = v): plain averaging is SGD with lr 1, FedAvgM is SGD with momentum, and FedAdam,
FedYogi and FedAdagrad follow Reddi et al. 2021 (Algorithm 2, no bias correction, v_0 = tau^2).
"""

from __future__ import annotations

import math

import torch

from fl_lightning.configurable import Configurable
from fl_lightning.errors import ConfigError


class ServerOptimizer(Configurable):
    """Applies x <- x - step(g) in place; keeps its state in `self.state` for checkpoints."""

    def __init__(self, lr: float = 1.0):
        _check_positive("lr", lr)
        self.lr = lr
        self.state: dict[str, torch.Tensor] = {}

    def step(self, params: torch.Tensor, pseudo_gradient: torch.Tensor) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        self.state = {k: v.to(device) for k, v in state.items()}


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"server_optimizer.{name}", "a finite value > 0", value)


def _check_beta(name: str, value: float) -> None:
    if not 0 <= value < 1:  # also refuses nan
        raise ConfigError(f"server_optimizer.{name}", "a value in [0, 1)", value)


class ServerSGD(ServerOptimizer):
    """x <- x - lr * m with m <- momentum * m + g (FedAvgM, Hsu et al. 2019); lr 1 and momentum 0
    is plain averaging."""

    def __init__(self, lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False):
        super().__init__(lr)
        _check_beta("momentum", momentum)
        if nesterov and momentum == 0:
            raise ConfigError("server_optimizer.momentum", "> 0 when nesterov is true", momentum)
        self.momentum = momentum
        self.nesterov = nesterov

    def step(self, params: torch.Tensor, pseudo_gradient: torch.Tensor) -> None:
        direction = pseudo_gradient
        if self.momentum:
            buffer = self.state.get("momentum")
            buffer = pseudo_gradient.clone() if buffer is None else buffer.mul_(self.momentum).add_(pseudo_gradient)
            self.state["momentum"] = buffer
            direction = pseudo_gradient + self.momentum * buffer if self.nesterov else buffer
        params.sub_(self.lr * direction)


class _AdaptiveServerOptimizer(ServerOptimizer):
    """Shared arithmetic of FedAdagrad, FedAdam and FedYogi; subclasses give the second moment."""

    def __init__(self, lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3):
        super().__init__(lr)
        _check_beta("beta1", beta1)
        _check_beta("beta2", beta2)
        _check_positive("tau", tau)
        self.beta1, self.beta2, self.tau = beta1, beta2, tau

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self, params: torch.Tensor, pseudo_gradient: torch.Tensor) -> None:
        delta = -pseudo_gradient  # Reddi et al. write the update as Delta = mean(y_i - x)
        m = self.state.get("first_moment", torch.zeros_like(delta))
        v = self.state.get("second_moment", torch.full_like(delta, self.tau**2))
        m = self.beta1 * m + (1 - self.beta1) * delta
        v = self.second_moment(v, delta * delta)
        self.state["first_moment"], self.state["second_moment"] = m, v
        params.add_(self.lr * m / (v.sqrt() + self.tau))


class FedAdagrad(_AdaptiveServerOptimizer):
    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v + delta_sq


class FedAdam(_AdaptiveServerOptimizer):
    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return self.beta2 * v + (1 - self.beta2) * delta_sq


class FedYogi(_AdaptiveServerOptimizer):
    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.beta2) * delta_sq * torch.sign(v - delta_sq)


__all__ = ["ServerOptimizer", "ServerSGD", "FedAdagrad", "FedAdam", "FedYogi"]
