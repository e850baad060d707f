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
    """`vector` scaled down to L2 norm `max_norm` if longer (unchanged when max_norm is None).
    Tensor arithmetic throughout: no host synchronisation, and it runs per client under vmap."""
    if max_norm is None:
        return vector
    return vector * (max_norm / (vector.norm() + 1e-12)).clamp(max=1.0)


class LocalSGD:
    """SGD with momentum, weight decay, Nesterov and clipping, written out on flat vectors.

    `project` (optional) maps the direction after weight decay and before momentum; FedCONST's
    constraint projection plugs in here so that momentum only ever accumulates projected steps.
    Momentum starts at zero every round, as in all reference code. `step` returns the new
    parameters rather than updating them in place, so the same code steps one client or, under
    vmap, each of a group. `active_steps` (one bool per step, grouped clients only) marks the
    steps a client of a group takes; on the others its parameters and momentum stay as they are.
    """

    def __init__(self, args: ClientOptimizerArgs, project: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 active_steps: Optional[torch.Tensor] = None):
        self.args = args
        self.project = project
        self.active_steps = active_steps
        self.momentum_buffer: Optional[torch.Tensor] = None
        self.steps_taken = 0

    def step(self, params: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        args = self.args
        gradient = clip_to_norm(gradient, args.grad_clip_norm)
        direction = gradient + args.weight_decay * params if args.weight_decay else gradient
        if self.project is not None:
            direction = self.project(direction)
        previous_momentum = self.momentum_buffer
        if args.momentum:
            self.momentum_buffer = direction if previous_momentum is None else (
                previous_momentum * args.momentum + direction)
            direction = direction + args.momentum * self.momentum_buffer if args.nesterov else self.momentum_buffer
        new_params = params - args.lr * direction
        if self.active_steps is not None and self.steps_taken > 0:  # every client takes step 0
            active = self.active_steps[self.steps_taken]
            new_params = torch.where(active, new_params, params)
            if args.momentum:
                self.momentum_buffer = torch.where(active, self.momentum_buffer, previous_momentum)
        self.steps_taken += 1
        return new_params


PADDING_LABEL = -100
"""The label of a padding sample in a grouped client's batch (a client's batch shorter than the
group's): F.cross_entropy's default ignore_index, so losses average over the client's own samples."""


@dataclass
class ClientRun:
    """One client's share of one round.

    Algorithms read and write it the same way whether it runs alone or, in the grouped path, as
    one of a group under `torch.func.vmap` (`vectorised`): then every tensor below is one client's
    slice of the group's, and the code must stay tensor arithmetic (no `.item()`, no branching on
    values)."""

    client_id: int
    round: int
    num_samples: int
    global_params: torch.Tensor
    """The global model x as a flat vector (read only)."""
    buffers: torch.Tensor
    """This client's copy of the model's float buffers (BatchNorm running stats); each training
    pass replaces it with the updated statistics, and it is averaged into the global buffers."""
    state: dict[str, torch.Tensor]
    """Persistent per-client state of stateful algorithms, written back after the round."""
    optimizer_args: ClientOptimizerArgs
    projection: Optional[Callable[[torch.Tensor], torch.Tensor]]
    """The round's constraint projection of local directions (FedCONST), or None."""
    trainer: "LocalTrainer"
    """The rank's trainer that built this run (shared by the round's clients on this rank)."""
    num_steps: "int | torch.Tensor"
    """Local steps this round: K_i (a tensor when grouped clients differ in it)."""
    _positions: list[torch.Tensor]
    _sample_indices: torch.Tensor
    _generator: torch.Generator
    losses: list[torch.Tensor] = field(default_factory=list)
    vectorised: bool = False
    client_weights: Optional[torch.Tensor] = None
    """Set when this run stands for a group of clients fused into one (`Algorithm.fuses_clients`):
    their weights, summing to 1. Its buffers, batches and losses are then the group's, stacked per
    client, and each gradient it takes is the weighted mean of the clients' gradients, each at the
    same parameters on its own batch."""
    _batches: Optional[list[Batch]] = None
    _active_steps: Optional[torch.Tensor] = None

    def batches(self) -> Iterator[Batch]:
        """The client's `num_steps` mini-batches, augmented and normalised on the device; all made
        on first use, so no step waits on a transfer from the host, and kept: a diagnostic that
        looks at them after the update gets the very batches it trained on, drawing nothing."""
        if self._batches is None:
            self._batches = self.trainer.make_batches(self._sample_indices, self._positions, self._generator)
        return iter(self._batches)

    def loss_and_grad(self, params: torch.Tensor, batch: Batch, training_pass: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's training loss at flat `params` on `batch`, and its gradient (flat).

        A training pass updates this client's BatchNorm running statistics and counts towards its
        train loss; an extra evaluation on the same batch (FedSAM's ascent point) does neither."""
        loss, gradient, buffers = self.trainer.loss_grad_and_buffers(params, self.buffers, batch, self.vectorised,
                                                                     self.client_weights)
        if training_pass:
            self.buffers = buffers
            self.losses.append(loss)
        return loss, gradient

    def gradient(self, function: Callable[[torch.Tensor], torch.Tensor], params: torch.Tensor) -> torch.Tensor:
        """The gradient of the scalar `function` at `params` (autograd alone, torch.func in a group)."""
        return differentiate(function, params, self.vectorised)[0]

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
    def batch_sizes(self) -> list[int]:
        return [len(positions) for positions in self._positions]

    def local_sgd(self) -> LocalSGD:
        """A fresh local optimizer (momentum reset) that applies the round's constraint, if any."""
        return LocalSGD(self.optimizer_args, self.projection, self._active_steps)

    @property
    def mean_loss(self) -> torch.Tensor:
        """The mean training loss of the client's steps, left on the device (no host sync)."""
        return torch.stack(self.losses).mean()


def differentiate(function: Callable, params: torch.Tensor, functional: bool, has_aux: bool = False):
    """(gradient of `function` at `params`, its value[, aux]): `torch.autograd.grad` for one client,
    `torch.func.grad_and_value` under vmap, where autograd.grad cannot run (same numbers)."""
    if functional:
        gradient, value = torch.func.grad_and_value(function, has_aux=has_aux)(params)
        return (gradient, *value) if has_aux else (gradient, value)
    params = params.detach().requires_grad_(True)
    value = function(params)
    loss = value[0] if has_aux else value
    (gradient,) = torch.autograd.grad(loss, params)
    return (gradient, loss.detach(), *value[1:]) if has_aux else (gradient, loss.detach())


class ForwardFeaturesCall(nn.Module):
    """Routes `functional_call` to the network's `forward_features` (MOON's representations), as
    `TrainingStepCall` routes it to `training_step`; the same attribute name gives the same tensor
    names."""

    def __init__(self, module: ClassificationModule):
        super().__init__()
        self.module = module

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.module.network.forward_features(inputs)


class LocalTrainer:
    """Builds `ClientRun`s on one rank and evaluates the module's loss at arbitrary flat parameters."""

    def __init__(self, fabric, module: ClassificationModule, *, images: torch.Tensor, labels: torch.Tensor, transform,
                 param_layout: FlatLayout, buffer_layout: FlatLayout, global_params: torch.Tensor,
                 global_buffers: torch.Tensor, client_indices: list[torch.Tensor], seed: int,
                 federation: FederationArgs, optimizer_args: ClientOptimizerArgs, constraint=None,
                 channels_last: bool = False, compile_steps: bool = False):
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
        self.channels_last = channels_last
        # The call of a client step outside vmap; under vmap (the grouped path) the eager call is
        # used, as compiled code does not reach there.
        self._loop_call = torch.compile(self._call_with_buffers) if compile_steps else self._call_with_buffers
        # functional_call's search for tied weights costs a walk over the module per step: only
        # where a tensor is registered under two names.
        self.tied_weights = (len(list(module.named_parameters(remove_duplicate=False)))
                             != len(list(module.named_parameters())))

    def make_batches(self, sample_indices: torch.Tensor, positions: list[torch.Tensor], generator: torch.Generator
                     ) -> list[Batch]:
        """A client's mini-batches (`positions` into `sample_indices`), augmented from `generator`
        batch after batch and normalised: all at once, with one transfer to the device and one
        augmentation pass over them all."""
        sizes = [len(batch) for batch in positions]
        indices = sample_indices[torch.cat(positions)].to(self.train_images.device, non_blocking=True)
        crops = None
        if self.transform.augment:
            per_batch = [self.transform.draw_crops(size, generator) for size in sizes]
            crops = tuple(torch.cat(draws) for draws in zip(*per_batch))
        inputs = self.transform(self.train_images[indices], crops=crops)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return list(zip(inputs.split(sizes), self.train_labels[indices].split(sizes)))

    def _call_with_buffers(self, call: nn.Module, params: torch.Tensor, buffers: torch.Tensor, argument,
                           training: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """`call(argument)` in train mode (eval mode if not `training`) with the module's tensors
        replaced by views of the flat `params` and by copies of the flat `buffers`; returns the
        output and the buffers as the call left them (BatchNorm updates its running statistics in
        train mode). The copies are separate tensors because under vmap an in-place update through
        a view of one flat tensor would be lost."""
        from fl_lightning.module import TrainingStepCall

        buffer_copies = {name: view.clone() for name, view in self.buffer_layout.views(buffers).items()}
        tensors = {**self.param_layout.views(params), **buffer_copies}
        tensors.update({n: b.clone() for n, b in self.integer_buffers.items()})
        if self.module.training != training:
            self.module.train(training)
        with self.fabric.autocast():
            output = functional_call(call, {TrainingStepCall.prefix + n: t for n, t in tensors.items()}, (argument,),
                                     tie_weights=self.tied_weights)
        updated = torch.cat([t.reshape(-1) for t in buffer_copies.values()]) if buffer_copies else buffers
        return output, updated

    def _train_mode_call(self, call: nn.Module, params: torch.Tensor, buffers: torch.Tensor, argument,
                         training: bool = True) -> torch.Tensor:
        return self._call_with_buffers(call, params, buffers, argument, training)[0]

    def loss_grad_and_buffers(self, params: torch.Tensor, buffers: torch.Tensor, batch: Batch, functional: bool = False,
                              client_weights: Optional[torch.Tensor] = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The training loss at flat `params` on `batch`, its gradient, and the float buffers after
        the pass (`buffers` itself is left as it is); `functional` under vmap.

        With `client_weights`, `buffers` and `batch` are a fused group's, stacked per client: then
        each client's loss on its own batch, the gradient of their weighted sum, and each client's
        buffers. That is one forward and one backward pass over the concatenated batches, vmap
        keeping the clients apart only where the network normalises by batch statistics."""
        if client_weights is not None:
            def weighted_loss(p):
                losses, updated = torch.func.vmap(lambda b, inputs, labels: self._call_with_buffers(
                    self.call, p, b, (inputs, labels)), randomness="different")(buffers, *batch)
                return (client_weights * losses).sum(), (losses.detach(), updated.detach())

            gradient, _, (losses, updated) = differentiate(weighted_loss, params, functional, has_aux=True)
            return losses, gradient, updated
        call_with_buffers = self._call_with_buffers if functional else self._loop_call
        gradient, loss, updated = differentiate(
            lambda p: call_with_buffers(self.call, p, buffers, batch), params, functional, has_aux=True)
        return loss.detach(), gradient, updated.detach()

    def loss_and_grad(self, params: torch.Tensor, buffers: torch.Tensor, batch: Batch
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The training loss at flat `params` on `batch` and its gradient; `buffers` is read only."""
        return self.loss_grad_and_buffers(params, buffers, batch)[:2]

    def features(self, params: torch.Tensor, buffers: torch.Tensor, inputs: torch.Tensor,
                 training: bool = True) -> torch.Tensor:
        # In train mode BatchNorm normalises with the batch's statistics, as in `loss_and_grad`; the
        # running statistics it computes are dropped (the CE pass already counted this batch).
        return self._train_mode_call(self.features_call, params, buffers, inputs, training).float()

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
            num_steps=len(positions),
            _positions=positions,
            _sample_indices=sample_indices,
            _generator=generator,
        )
