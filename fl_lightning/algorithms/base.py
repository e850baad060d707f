"""The algorithm interface: a client rule, a server rule, and the state each keeps.

A configured algorithm is hyper-parameters only (frozen once built, so one serves any number of
runs): the server's state of a run is the `ServerState` that `setup` returns and the round loop
owns, passed to `server_update` and `round_metrics` and read by clients as `ClientRound.server`.

Shared mechanics (sampling, weights, flattening, the all-reduce, checkpoints) live in
`fl_lightning.federation`; an algorithm module holds only what makes it different.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Optional

import numpy as np
import torch
from torch import nn

from fl_lightning.algorithms.costs import Cost, Passes
from fl_lightning.choices import Weighting
from fl_lightning.clients import Batch, ClientRound
from fl_lightning.config import FederationArgs
from fl_lightning.configurable import FrozenConfigurable
from fl_lightning.server_optimizers import ServerOptimizer, ServerState

PSEUDO_GRADIENT = "pseudo_gradient"
SHORT_NAMES: dict[str, type["Algorithm"]] = {}
FORMER_NAMES: dict[str, type["Algorithm"]] = {}
"""The short names and class names that renamed classes went by (`Algorithm.former_names`)."""


class Algorithm(FrozenConfigurable):
    """Base class. A subclass sets its uploads and overrides `client_update` (and, if its server
    does more than step the server optimizer on the pseudo-gradient, `server_update`).

    Uploads are flat vectors the size of the model, or short ones of a declared length (a scalar, a
    per-client count). Those in `weighted_uploads` and `weighted_short_uploads` are aggregated as
    sum_i p_i * upload_i (p from `weighting`), those in `summed_uploads` and `summed_short_uploads` as
    sum_i upload_i, all in one all-reduce, and each is counted at its size in the run's upload bytes.
    """

    short_name: ClassVar[str] = ""
    """The name `--algorithm` accepts on the command line (e.g. fedavg), and that its runs go by; a
    class's own: a subclass without one of its own is neither (a variant of FedAvg is not FedAvg)."""
    former_names: ClassVar[tuple[str, ...]] = ()
    """The short name and class name a renamed class went by (a class's own, as `short_name`): still
    accepted wherever a short name or class name is, and its former short name is still what its runs
    are named by (`method_name`), so that the runs made before and after the rename share their run
    folders, W&B groups and rows. Its former module stays, so its former class path resolves too."""
    trains_locally: ClassVar[bool] = True
    """Whether clients run local SGD (so a constraint such as CONST applies to them)."""
    default_weighting: ClassVar[Weighting] = "num_samples"
    weighted_uploads: ClassVar[tuple[str, ...]] = (PSEUDO_GRADIENT,)
    summed_uploads: ClassVar[tuple[str, ...]] = ()
    weighted_short_uploads: ClassVar[dict[str, int]] = {}
    """Uploads shorter than the model, name -> length (1 for a number), aggregated as sum_i p_i * value_i
    in the same all-reduce (FedNova's tau_eff)."""
    summed_short_uploads: ClassVar[dict[str, int]] = {}
    """Uploads shorter than the model, name -> length, aggregated as sum_i value_i (a count of clients)."""
    client_state: ClassVar[tuple[str, ...]] = ()
    """Names of per-client vectors that persist across rounds (e.g. SCAFFOLD's c_i)."""
    cost: ClassVar[Cost] = Cost()
    """What a client of the method spends in a round (`fl_lightning.algorithms.costs`): one forward and
    one backward pass per local step, its update up, the model down."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("short_name"):
            SHORT_NAMES[cls.short_name] = cls
        FORMER_NAMES.update(dict.fromkeys(cls.__dict__.get("former_names", ()), cls))

    @classmethod
    def method_name(cls) -> str:
        """What the runs of this class are named and grouped by: its own short name (the one it went by
        first, if it was renamed), else its class name."""
        former = cls.__dict__.get("former_names")
        return former[0] if former else cls.__dict__.get("short_name") or cls.__name__

    def prepare_model(self, network: nn.Module) -> nn.Module:
        """Adapt the freshly initialised network before training (e.g. MOON adds a projection
        head); the same on every rank."""
        return network

    def check_federation(self, federation: FederationArgs, client_sizes: np.ndarray) -> None:
        """Refuse a federation this algorithm cannot run as published (ConfigError); called once
        the data is split, before training, with every client's number of samples."""

    def server_optimizer_for(self, configured: ServerOptimizer) -> ServerOptimizer:
        """The server optimizer this algorithm runs with, given the configured one; checked before
        any data is loaded (FedAvgM adds its momentum here)."""
        return configured

    def setup(self, server_optimizer: ServerOptimizer, num_params: int, num_clients: int,
              device: torch.device) -> ServerState:
        """The server's state of a fresh run, made once on every rank before the first round (a resume
        then loads the saved one into it)."""
        return ServerState(server_optimizer, num_clients, self.initial_server_state(num_params, device))

    def initial_server_state(self, num_params: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The algorithm's own server tensors before the first round (`ServerState.tensors`)."""
        return {}

    @property
    def fuses_clients(self) -> bool:
        """Whether the grouped path may compute a group of clients as one (`Execution.client_weights`),
        each gradient the group's weighted mean: right for a stateless rule whose clients all take
        their gradients at the same points and whose uploads are affine in those gradients, so that
        the fused run's uploads are the group's weighted mean uploads (CTP-FL). One backward pass
        then serves the whole group; a client's own uploads are computed again, alone, only for a
        callback that reads them (`on_client_end`)."""
        return False

    def step_passes(self, reported_before: bool) -> Passes:
        """The passes of one local step of a client that has (or has not) reported an update in an
        earlier round: `cost.passes`, unless the rule differs on a client's first round (MOON)."""
        return self.cost.passes

    def rebuilds_from_models(self, server_optimizer: ServerOptimizer, equal_steps: bool) -> bool:
        """Whether `cost.rebuilt_down` is the server's last step over a constant under this server
        optimizer, when the clients that reported in that step's round took `equal_steps` (or not)."""
        return True

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def server_update(self, state: ServerState, params: torch.Tensor, aggregate: dict[str, torch.Tensor]) -> None:
        """Update the global parameters and the server's `state` in place from the aggregated uploads
        (same on every rank)."""
        state.step(params, aggregate[PSEUDO_GRADIENT])

    def round_metrics(self, state: ServerState) -> dict[str, float]:
        """Extra per-round scalars to log after `server_update`."""
        return {}


Direction = Callable[[torch.Tensor, torch.Tensor, Batch], torch.Tensor]


def train_locally(client: ClientRound, direction: Optional[Direction] = None) -> torch.Tensor:
    """The local SGD loop shared by the local-update methods: returns the final local model y.

    `direction(y, g, batch)` (optional) turns each mini-batch gradient g at y into what the local
    optimizer steps along: SCAFFOLD adds c - c_i, FedProx mu (y - x), FedAvg-M mixes in the global
    direction, FedSAM re-evaluates g at its ascent point. Weight decay and a constraint's projection
    are the optimizer's and come after.
    """
    params = client.global_params
    optimizer = client.local_sgd()
    for batch in client.batches():
        _, gradient = client.loss_and_grad(params, batch)
        if direction is not None:
            gradient = direction(params, gradient, batch)
        params = optimizer.step(params, gradient)
    return params
