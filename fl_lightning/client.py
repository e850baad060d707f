"""What a client's local update works with: its mini-batch stream, the loss and its gradient at
any parameters, and an explicit local SGD.

Everything a client draws comes from a generator seeded by (seed, round, client), never by rank,
so a run gives the same model on 1, 2 or 8 ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fl_lightning.config import ClientOptimizerArgs, FederationArgs
from fl_lightning.flat import FlatLayout

if TYPE_CHECKING:  # fl_lightning.module imports Lightning, which the command line need not wait for
    from fl_lightning.module import ClassificationModule

Batch = tuple[torch.Tensor, torch.Tensor]


# Separate streams, so that a client's batches never share random numbers with client sampling.
SAMPLING_STREAM = 0
CLIENT_STREAM = 1


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator whose stream depends only on `keys` (e.g. seed, stream, round, client)."""
    state = np.random.SeedSequence([int(k) for k in keys]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


def batch_positions(
    num_samples: int,
    batch_size: int,
    local_steps: Optional[int],
    local_epochs: Optional[int],
    generator: torch.Generator,
) -> list[torch.Tensor]:
    """Positions into the client's sample list for each local step.

    `local_epochs`: each epoch is a fresh permutation cut into ceil(n / B) batches (the last may be
    smaller). `local_steps`: K batches of exactly B from back-to-back permutations.
    """
    if local_epochs is not None:
        return [
            chunk
            for _ in range(local_epochs)
            for chunk in torch.randperm(num_samples, generator=generator).split(batch_size)
        ]
    needed = local_steps * batch_size
    permutations = [torch.randperm(num_samples, generator=generator) for _ in range(math.ceil(needed / num_samples))]
    return list(torch.cat(permutations)[:needed].split(batch_size))


def clip_to_norm(vector: torch.Tensor, max_norm: Optional[float]) -> torch.Tensor:
    """`vector` scaled down to L2 norm `max_norm` if longer (unchanged when max_norm is None)."""
    if max_norm is None:
        return vector
    return vector * min(1.0, max_norm / (vector.norm().item() + 1e-12))


class LocalSGD:
    """SGD with momentum, weight decay, Nesterov and clipping, written out on flat vectors.

    `project` (optional) maps the direction after weight decay and before momentum; FedCONST's
    constraint projection plugs in here so that momentum only ever accumulates projected steps.
    Momentum starts at zero every round, as in all reference code.
    """

    def __init__(self, args: ClientOptimizerArgs, project: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.args = args
        self.project = project
        self.momentum_buffer: Optional[torch.Tensor] = None

    def step(self, params: torch.Tensor, gradient: torch.Tensor) -> None:
        args = self.args
        gradient = clip_to_norm(gradient, args.grad_clip_norm)
        direction = gradient + args.weight_decay * params if args.weight_decay else gradient
        if self.project is not None:
            direction = self.project(direction)
        if args.momentum:
            if self.momentum_buffer is None:
                self.momentum_buffer = direction.clone()
            else:
                self.momentum_buffer.mul_(args.momentum).add_(direction)
            direction = direction + args.momentum * self.momentum_buffer if args.nesterov else self.momentum_buffer
        params.add_(direction, alpha=-args.lr)


@dataclass
class ClientRun:
    """One client's share of one round."""

    client_id: int
    round: int
    num_samples: int
    global_params: torch.Tensor
    """The global model x as a flat vector (read only)."""
    buffers: torch.Tensor
    """This client's copy of the model's float buffers (BatchNorm running stats); train-mode
    forward passes update it, and it is averaged into the global buffers."""
    state: dict[str, torch.Tensor]
    """Persistent per-client state of stateful algorithms, written back after the round."""
    optimizer_args: ClientOptimizerArgs
    projection: Optional[Callable[[torch.Tensor], torch.Tensor]]
    """The round's constraint projection of local directions (FedCONST), or None."""
    trainer: "LocalTrainer"
    """The rank's trainer that built this run (shared by the round's clients on this rank)."""
    _positions: list[torch.Tensor]
    _sample_indices: torch.Tensor
    _generator: torch.Generator
    losses: list[torch.Tensor] = field(default_factory=list)

    def batches(self) -> Iterator[Batch]:
        """The client's `num_steps` mini-batches, augmented and normalised on the device."""
        for positions in self._positions:
            yield self.trainer.make_batch(self._sample_indices[positions], self._generator)

    def replay_batches(self) -> Iterator[Batch]:
        """The same mini-batches as `batches()`, augmentation included, drawn again from a fresh
        generator seeded as this client's: what a diagnostic recomputes without moving the run's
        own random stream."""
        generator = self.trainer.client_generator(self.client_id, self.round)
        self.trainer.batch_order(len(self._sample_indices), generator)  # as client_run drew it first
        for positions in self._positions:
            yield self.trainer.make_batch(self._sample_indices[positions], generator)

    def loss_and_grad(self, params: torch.Tensor, batch: Batch, training_pass: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's training loss at flat `params` on `batch`, and its gradient (flat).

        A training pass updates this client's BatchNorm running statistics and counts towards its
        train loss; an extra evaluation on the same batch (FedSAM's ascent point) does neither."""
        buffers = self.buffers if training_pass else self.buffers.clone()
        loss, gradient = self.trainer.loss_and_grad(params, buffers, batch)
        if training_pass:
            self.losses.append(loss)
        return loss, gradient

    def features(self, params: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The network's `forward_features` at flat `params` on `inputs`, differentiable in `params`;
        computed as in training, without touching this client's running statistics."""
        return self.trainer.features(params, self.buffers, inputs)

    def frozen_features(self, params: torch.Tensor, buffers: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """`forward_features` of a fixed model (flat `params` and float `buffers`) on `inputs` in eval
        mode, without gradients: BatchNorm normalises with the running statistics in `buffers` (left
        unchanged), dropout is off."""
        with torch.no_grad():
            return self.trainer.features(params, buffers, inputs, training=False)

    @property
    def num_steps(self) -> int:
        return len(self._positions)

    @property
    def batch_sizes(self) -> list[int]:
        return [len(positions) for positions in self._positions]

    def local_sgd(self) -> LocalSGD:
        """A fresh local optimizer (momentum reset) that applies the round's constraint, if any."""
        return LocalSGD(self.optimizer_args, self.projection)

    @property
    def mean_loss(self) -> float:
        # One host sync per client rather than one per step.
        return torch.stack(self.losses).mean().item() if self.losses else float("nan")


class ForwardFeaturesCall(nn.Module):
    """Routes `functional_call` to the network's `forward_features` (MOON's representations), as
    `TrainingStepCall` routes it to `training_step`; the same attribute name gives the same tensor
    names."""

    def __init__(self, module: ClassificationModule):
        super().__init__()
        self.module = module

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.module.network.forward_features(inputs)


def vectorisable(clients: list[ClientRun]) -> bool:
    """Whether these clients' gradients can be computed together by `group_loss_and_grads`: more
    than one, a model without buffers (BatchNorm statistics must stay per client) and the same
    sequence of batch sizes for all."""
    trainer = clients[0].trainer if clients else None
    return (len(clients) > 1 and trainer.buffer_layout.numel == 0 and not trainer.integer_buffers
            and len({tuple(client.batch_sizes) for client in clients}) == 1)


def group_loss_and_grads(clients: list[ClientRun], params: torch.Tensor, batches: list[Batch]) -> torch.Tensor:
    """Every client's gradient at the same `params`, each on its own batch, in one vectorised pass
    (rows in the clients' order); each client records its loss as `loss_and_grad` would."""
    losses, gradients = clients[0].trainer.loss_and_grads_per_client(params, batches)
    for client, loss in zip(clients, losses):
        client.losses.append(loss)
    return gradients


class LocalTrainer:
    """Builds `ClientRun`s on one rank and evaluates the module's loss at arbitrary flat parameters."""

    def __init__(self, fabric, module: ClassificationModule, *, images: torch.Tensor, labels: torch.Tensor, transform,
                 param_layout: FlatLayout, buffer_layout: FlatLayout, global_params: torch.Tensor,
                 global_buffers: torch.Tensor, client_indices: list[torch.Tensor], seed: int,
                 federation: FederationArgs, optimizer_args: ClientOptimizerArgs, constraint=None):
        """Everything that stays the same for the whole run: the rank's copy of the training data,
        the global model (flat tensors the server updates in place), each client's sample indices
        and the local budget and optimizer."""
        from fl_lightning.module import TrainingStepCall

        self.fabric = fabric
        self.module = module
        self.call = TrainingStepCall(module)
        self.features_call = ForwardFeaturesCall(module)
        self.train_images = images
        self.train_labels = labels
        self.transform = transform
        self.param_layout = param_layout
        self.buffer_layout = buffer_layout
        self.global_params = global_params
        self.global_buffers = global_buffers
        self.client_indices = client_indices
        self.seed = seed
        self.federation = federation
        self.optimizer_args = optimizer_args
        self.constraint = constraint
        # Integer buffers (BatchNorm's num_batches_tracked) are not averaged; each client gets a copy.
        self.integer_buffers = {n: b for n, b in module.named_buffers() if not b.is_floating_point()}

    def make_batch(self, indices: torch.Tensor, generator: torch.Generator) -> Batch:
        indices = indices.to(self.train_images.device)
        return self.transform(self.train_images[indices], generator), self.train_labels[indices]

    def _train_mode_call(self, call: nn.Module, params: torch.Tensor, buffers: torch.Tensor, argument,
                         training: bool = True):
        """`call(argument)` in train mode (eval mode if not `training`) with the module's tensors
        replaced by views of the flat `params` and `buffers` (which BatchNorm's running statistics
        update in place in train mode)."""
        from fl_lightning.module import TrainingStepCall

        tensors = {**self.param_layout.views(params), **self.buffer_layout.views(buffers)}
        tensors.update({n: b.clone() for n, b in self.integer_buffers.items()})
        self.module.train(training)
        with self.fabric.autocast():
            return functional_call(call, {TrainingStepCall.prefix + n: t for n, t in tensors.items()}, (argument,))

    def loss_and_grad(self, params: torch.Tensor, buffers: torch.Tensor, batch: Batch
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        params = params.detach().requires_grad_(True)
        loss = self._train_mode_call(self.call, params, buffers, batch)
        (gradient,) = torch.autograd.grad(loss, params)
        return loss.detach(), gradient

    def loss_and_grads_per_client(self, params: torch.Tensor, batches: list[Batch]
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each client's training loss at the same flat `params` on its own batch, and its gradient:
        one vectorised forward/backward (`torch.func.vmap`) over the clients' stacked batches
        instead of one per client. Only for models without buffers, whose per-client results do
        not depend on batch statistics kept across calls."""
        def loss_at(shared_params: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return self._train_mode_call(self.call, shared_params, torch.zeros(0, device=shared_params.device),
                                         (inputs, targets))

        inputs = torch.stack([inputs for inputs, _ in batches])
        targets = torch.stack([targets for _, targets in batches])
        gradients, losses = torch.func.vmap(torch.func.grad_and_value(loss_at), in_dims=(None, 0, 0))(
            params.detach(), inputs, targets)
        return losses.detach(), gradients

    def features(self, params: torch.Tensor, buffers: torch.Tensor, inputs: torch.Tensor,
                 training: bool = True) -> torch.Tensor:
        # A copy of the buffers: in train mode BatchNorm normalises with the batch's statistics, as
        # in `loss_and_grad`, but its running statistics must not be updated a second time.
        return self._train_mode_call(self.features_call, params, buffers.clone(), inputs, training).float()

    def client_generator(self, client_id: int, round_index: int) -> torch.Generator:
        """The stream of everything the client draws in the round: its batch order, then its
        augmentations."""
        return seeded_generator(self.seed, CLIENT_STREAM, round_index, client_id)

    def batch_order(self, num_samples: int, generator: torch.Generator) -> list[torch.Tensor]:
        federation = self.federation
        return batch_positions(num_samples, federation.batch_size, federation.local_steps, federation.local_epochs,
                               generator)

    def client_run(self, client_id: int, round_index: int, state: dict[str, torch.Tensor]) -> ClientRun:
        generator = self.client_generator(client_id, round_index)
        sample_indices = self.client_indices[client_id]
        positions = self.batch_order(len(sample_indices), generator)
        projection = None if self.constraint is None else self.constraint.projection(self.global_params,
                                                                                     self.param_layout)
        return ClientRun(
            client_id=client_id,
            round=round_index,
            num_samples=len(sample_indices),
            global_params=self.global_params,
            buffers=self.global_buffers.clone(),
            state=state,
            optimizer_args=self.optimizer_args,
            projection=projection,
            trainer=self,
            _positions=positions,
            _sample_indices=sample_indices,
            _generator=generator,
        )
