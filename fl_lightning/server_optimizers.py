"""The server's step on the aggregated pseudo-gradient, one swappable component.

Every algorithm hands the server a pseudo-gradient g (for FedAvg g = sum_i p_i (x - y_i), for
CTP-FL g = v): plain averaging is SGD with lr 1, FedAvgM is SGD with momentum, and FedAdam,
FedYogi and FedAdagrad follow Reddi et al. 2021 (Algorithm 2, no bias correction, v_0 = tau^2).

A server optimizer is hyper-parameters only (frozen once built); what it keeps between rounds
(momentum, moments) is the run's, in its `ServerState` beside the algorithm's own server tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fl_lightning.configurable import FrozenConfigurable
from fl_lightning.errors import ConfigError

OptimizerState = dict[str, torch.Tensor]


class ServerOptimizer(FrozenConfigurable):
    """Applies x <- x - step(g) in place, reading and writing its state in the run's `state`."""

    def __init__(self, lr: float = 1.0):
        _check_positive("lr", lr)
        self.lr = lr

    def step(self, state: OptimizerState, params: torch.Tensor, pseudo_gradient: torch.Tensor) -> None:
        raise NotImplementedError


@dataclass
class ServerState:
    """What the server of one run keeps between rounds, on every rank: made by `Algorithm.setup`, owned
    by the round loop (which checkpoints it) and read by the clients of a round (`ClientRound.server`)."""

    optimizer: ServerOptimizer
    """The server optimizer the run steps with (`Algorithm.server_optimizer_for` of the configured one)."""
    num_clients: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """The algorithm's own (SCAFFOLD's control c, CTP-FL's direction v, FedDyn's h)."""
    optimizer_state: OptimizerState = field(default_factory=dict)
    """The server optimizer's (its momentum, its moments)."""

    def step(self, params: torch.Tensor, pseudo_gradient: torch.Tensor) -> None:
        """The server optimizer's step of `params` in place on `pseudo_gradient`."""
        self.optimizer.step(self.optimizer_state, params, pseudo_gradient)

    def state_dict(self) -> dict:
        """The checkpoint's `algorithm` entry."""
        return {"server_state": _on_host(self.tensors), "server_optimizer": _on_host(self.optimizer_state)}

    def load_state_dict(self, saved: dict, device: torch.device) -> None:
        self.tensors = {k: v.to(device) for k, v in saved["server_state"].items()}
        self.optimizer_state = {k: v.to(device) for k, v in saved["server_optimizer"].items()}


def _on_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in tensors.items()}


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

    def step(self, state: OptimizerState, params: torch.Tensor, pseudo_gradient: torch.Tensor) -> None:
        direction = pseudo_gradient
        if self.momentum:
            buffer = state.get("momentum")
            buffer = pseudo_gradient.clone() if buffer is None else buffer.mul_(self.momentum).add_(pseudo_gradient)
            state["momentum"] = buffer
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

    def step(self, state: OptimizerState, params: torch.Tensor, pseudo_gradient: torch.Tensor) -> None:
        delta = -pseudo_gradient  # Reddi et al. write the update as Delta = mean(y_i - x)
        m = state.get("first_moment", torch.zeros_like(delta))
        v = state.get("second_moment", torch.full_like(delta, self.tau**2))
        m = self.beta1 * m + (1 - self.beta1) * delta
        v = self.second_moment(v, delta * delta)
        state["first_moment"], state["second_moment"] = m, v
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
