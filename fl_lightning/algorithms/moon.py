"""MOON (Li et al. 2021): model-contrastive local training.

The network gains a projection head, as in the paper and its code: base encoder -> 2-layer MLP
(feature_dim -> feature_dim -> ReLU -> projection_dim) -> output layer, so the classifier reads the
projection z and the head is part of the global model. The local loss on a batch is

    CE + mu * CE([cos(z, z_glob), cos(z, z_prev)] / tau, target 0)

with z_glob from the global model x and z_prev from the client's own previous local model (stored
as client state). As in the authors' code (main.py, train_net_fedcon), both are representations
of frozen models: computed in eval mode and not differentiated. In eval mode BatchNorm normalises
with running statistics and dropout is off: z_glob uses the global model's buffers as the round
received them, z_prev the buffers the client's previous local model ended its round with (kept
as client state beside its parameters; a checkpoint without them falls back to the global
buffers). z is the local model's, in train mode like the CE pass.

A client's first round. Here the contrastive term is left out. In the authors' code the pool of
previous models is empty during round 0, so the logits hold only the positive column and the term
is exactly zero (value and gradient); with every client sampled each round, as there by default,
every first round is round 0 and the two agree. Leaving the term out is also exact against using
the global model as the previous model (z_prev = z_glob): both logits are then equal, the softmax
is (1/2, 1/2), and the gradient -1/2 d cos(z, z_glob) + 1/2 d cos(z, z_glob) vanishes; only the
value, the constant mu log 2, differs (the contrastive value is not logged). Departure: under
partial participation, a client first sampled after round 0 is contrasted in the authors' code with
its own network as initialised before training (every party gets its own random initialisation
there, and the pool snapshots every party's network); this project has no such per-client
network and leaves the term out on that round too.

Absences and lost uploads. A client's previous model is its local model of the last round whose
upload reached the server, kept however many rounds it is offline; a client whose upload is lost
(`federation.dropout`) keeps the one before, as a client that failed after training would.

Gradient: the CE part is the module's own `training_step` (`client.loss_and_grad`); the
contrastive part is differentiated separately through `client.features` at the same parameters on
the same batch. With BatchNorm both passes normalise with the same batch statistics (and only the
CE pass updates the running statistics), so their sum is the gradient of the total loss. With
dropout the two passes draw independent masks, where the authors' code shares one forward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms.base import PSEUDO_GRADIENT, Algorithm, train_locally
from fl_lightning.algorithms.costs import Cost, Passes
from fl_lightning.clients import PADDING_LABEL, Batch, ClientRound
from fl_lightning.errors import ConfigError
from fl_lightning.models import FeatureClassifier

PREVIOUS_MODEL = "previous_model"
PREVIOUS_BUFFERS = "previous_buffers"


class ProjectedClassifier(FeatureClassifier):
    """`encoder`'s features -> projection head -> a new classifier on the projection.

    The encoder's own classifier would be dead weight and is replaced by an identity; a timm
    encoder keeps its head (timm owns it), which its pre-logits features never reach.
    """

    def __init__(self, encoder: FeatureClassifier, projection_dim: int):
        super().__init__()
        bias = encoder.classifier.bias is not None
        num_classes = encoder.classifier.out_features
        width = encoder.feature_dim
        if "classifier" in dict(encoder.named_children()):
            encoder.classifier = nn.Identity()
        self.encoder = encoder
        self.projection_head = nn.Sequential(
            nn.Linear(width, width, bias=bias), nn.ReLU(), nn.Linear(width, projection_dim, bias=bias)
        )
        self.feature_dim = projection_dim
        self.classifier = nn.Linear(projection_dim, num_classes, bias=bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection_head(self.encoder.forward_features(x))


class MOON(Algorithm):
    short_name = "moon"
    client_state = (PREVIOUS_MODEL, PREVIOUS_BUFFERS)
    # A step's CE pass; the representation z differentiated; z_glob and z_prev of the frozen models
    # (forward only). A client's first round has no contrastive term: the CE pass alone.
    cost = Cost(passes=Passes(forward=4, backward=2))

    def __init__(self, mu: float = 5.0, tau: float = 0.5, projection_dim: int = 256):
        """
        Args:
            mu: weight of the model-contrastive term (5 for CIFAR-10, 1 for CIFAR-100); 0 is FedAvg
                on the network with the projection head.
            tau: temperature of the contrastive softmax.
            projection_dim: output width of the projection head.
        """
        if mu < 0:
            raise ConfigError("algorithm.init_args.mu", "a value >= 0", mu)
        if tau <= 0:
            raise ConfigError("algorithm.init_args.tau", "a value > 0", tau)
        if isinstance(projection_dim, bool) or not isinstance(projection_dim, int) or projection_dim < 1:
            raise ConfigError("algorithm.init_args.projection_dim", "a positive integer", projection_dim)
        self.mu = mu
        self.tau = tau
        self.projection_dim = projection_dim

    def step_passes(self, reported_before: bool) -> Passes:
        return self.cost.passes if reported_before and self.mu else Passes()

    def prepare_model(self, network: nn.Module) -> nn.Module:
        return ProjectedClassifier(network, self.projection_dim)

    def client_update(self, client: ClientRound) -> dict[str, torch.Tensor]:
        # The buffers as received (training replaces client.buffers): the global model's.
        global_model = (client.global_params, client.buffers.clone())
        previous_model = client.state.get(PREVIOUS_MODEL)
        contrastive = None
        if previous_model is not None and self.mu:
            previous_model = (previous_model, client.state.get(PREVIOUS_BUFFERS, global_model[1]))

            def contrastive(params: torch.Tensor, gradient: torch.Tensor, batch: Batch) -> torch.Tensor:
                return gradient + self.contrastive_gradient(client, params, global_model, previous_model, batch)

        local_params = train_locally(client, direction=contrastive)
        client.state[PREVIOUS_MODEL] = local_params
        client.state[PREVIOUS_BUFFERS] = client.buffers.clone()
        return {PSEUDO_GRADIENT: client.global_params - local_params}

    def contrastive_gradient(self, client: ClientRound, params: torch.Tensor,
                             global_model: tuple[torch.Tensor, torch.Tensor],
                             previous_model: tuple[torch.Tensor, torch.Tensor], batch: Batch) -> torch.Tensor:
        """The gradient of mu * the contrastive loss at `params` on `batch`'s images; `global_model` and
        `previous_model` are (flat parameters, flat float buffers), represented in eval mode."""
        inputs, labels = batch
        global_features = client.frozen_features(*global_model, inputs)
        previous_features = client.frozen_features(*previous_model, inputs)
        # Target 0: the representation should agree with the global model's, not the stale one's.
        # Padding samples of a grouped client's batch keep their label, so they count for nothing.
        targets = torch.where(labels == PADDING_LABEL, PADDING_LABEL, 0)

        def contrastive_loss(params: torch.Tensor) -> torch.Tensor:
            features = client.features(params, inputs)
            logits = torch.stack([
                F.cosine_similarity(features, global_features, dim=1),
                F.cosine_similarity(features, previous_features, dim=1),
            ], dim=1) / self.tau
            return self.mu * F.cross_entropy(logits, targets, ignore_index=PADDING_LABEL)

        return client.gradient(contrastive_loss, params)
