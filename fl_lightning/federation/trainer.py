"""The rank's trainer: builds its clients' `ClientRound`s and evaluates the module's loss, its gradient
and its features at arbitrary flat parameters, the module's own tensors replaced by views of them
(`torch.func.functional_call`), so one client or, under vmap, a group of clients computes alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fl_lightning.clients.run import (
    CLIENT_STREAM,
    Batch,
    ClientRound,
    Execution,
    batch_positions,
    differentiate,
    planned_steps,
    seeded_generator,
)
from fl_lightning.data import ClientSamples
from fl_lightning.federation.aggregation import local_steps_done
from fl_lightning.federation.setup import RunSettings
from fl_lightning.server_optimizers import ServerState

if TYPE_CHECKING:  # fl_lightning.module imports Lightning, which the command line need not wait for
    from fl_lightning.module import ClassificationModule


@dataclass
class TrainingData:
    """The rank's copy of the training split, on its device, and the transform of its batches."""

    images: torch.Tensor
    labels: torch.Tensor
    transform: Callable
    """`fl_lightning.data.DeviceTransform` (or anything called as it is: images, crops=None)."""


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
    """Builds `ClientRound`s on one rank and evaluates the module's loss at arbitrary flat parameters."""

    def __init__(self, engine, module: ClassificationModule, data: TrainingData, global_model,
                 partition: Sequence[np.ndarray], settings: RunSettings):
        """Everything that stays the same for the whole run: the rank's copy of the training data,
        the global model (`fl_lightning.federation.FlatGlobalModel`: flat tensors the server updates
        in place), each client's sample indices (`partition`, ClientSamples or a list of arrays) and
        the run's settings."""
        from fl_lightning.module import TrainingStepCall

        self.engine = engine
        self.module = module
        self.call = TrainingStepCall(module)
        self.features_call = ForwardFeaturesCall(module)
        self.data = data
        self.global_model = global_model
        # Every client's indices in the partition's arrays, a client's tensor made when it trains: a
        # tensor a client kept would cost a few hundred bytes each, hundreds of MiB at a million clients.
        self.samples = ClientSamples.of(partition)
        self.settings = settings
        # Integer buffers (BatchNorm's num_batches_tracked) are not averaged; each client gets a copy.
        self.integer_buffers = {n: b for n, b in module.named_buffers() if not b.is_floating_point()}
        # The call of a client step outside vmap; under vmap (the grouped path) the eager call is
        # used, as compiled code does not reach there.
        self._loop_call = (torch.compile(self._call_with_buffers) if settings.compute.compile
                           else self._call_with_buffers)
        # functional_call's search for tied weights costs a walk over the module per step: only
        # where a tensor is registered under two names.
        self.tied_weights = (len(list(module.named_parameters(remove_duplicate=False)))
                             != len(list(module.named_parameters())))

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def global_buffers(self) -> torch.Tensor:
        return self.global_model.buffers

    def make_batches(self, sample_indices: torch.Tensor, positions: list[torch.Tensor], generator: torch.Generator
                     ) -> list[Batch]:
        """A client's mini-batches (`positions` into `sample_indices`), augmented from `generator`
        batch after batch and normalised: all at once, with one transfer to the device and one
        augmentation pass over them all."""
        sizes = [len(batch) for batch in positions]
        indices = sample_indices[torch.cat(positions)].to(self.data.images.device, non_blocking=True)
        crops = None
        if self.data.transform.augment:
            per_batch = [self.data.transform.draw_crops(size, generator) for size in sizes]
            crops = tuple(torch.cat(draws) for draws in zip(*per_batch))
        inputs = self.data.transform(self.data.images[indices], crops=crops)
        if self.settings.compute.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return list(zip(inputs.split(sizes), self.data.labels[indices].split(sizes)))

    def _call_with_buffers(self, call: nn.Module, params: torch.Tensor, buffers: torch.Tensor, argument,
                           training: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """`call(argument)` in train mode (eval mode if not `training`) with the module's tensors
        replaced by views of the flat `params` and by copies of the flat `buffers`; returns the
        output and the buffers as the call left them (BatchNorm updates its running statistics in
        train mode). The copies are separate tensors because under vmap an in-place update through
        a view of one flat tensor would be lost."""
        from fl_lightning.module import TrainingStepCall

        buffer_copies = {name: view.clone() for name, view in self.global_model.buffer_layout.views(buffers).items()}
        tensors = {**self.global_model.param_layout.views(params), **buffer_copies}
        tensors.update({n: b.clone() for n, b in self.integer_buffers.items()})
        if self.module.training != training:
            self.module.train(training)
        with self.engine.autocast():
            output = functional_call(call, {TrainingStepCall.prefix + n: t for n, t in tensors.items()}, (argument,),
                                     tie_weights=self.tied_weights)
        updated = torch.cat([t.reshape(-1) for t in buffer_copies.values()]) if buffer_copies else buffers
        return output, updated

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
        return self._call_with_buffers(self.features_call, params, buffers, inputs, training)[0].float()

    def client_samples(self, client_id: int) -> torch.Tensor:
        """The client's training-set indices (int64)."""
        return torch.from_numpy(self.samples[client_id].astype(np.int64))

    def steps_done(self, client_id: int, round_index: int) -> int:
        """The local steps the client does in round `round_index` (its planned K_i, or a straggler's share)."""
        federation = self.settings.federation
        planned = planned_steps(len(self.samples[client_id]), federation)
        return local_steps_done(self.settings.seed, round_index, client_id, federation, planned)

    def client_round(self, client_id: int, round_index: int, state: dict[str, torch.Tensor],
                     server: ServerState) -> ClientRound:
        """The client's share of round `round_index`, starting from the global model, its `state` and
        the `server`'s.
        Everything it draws comes from one stream: its batch order, then its augmentations."""
        settings, global_model = self.settings, self.global_model
        generator = seeded_generator(settings.seed, CLIENT_STREAM, round_index, client_id)
        sample_indices = self.client_samples(client_id)
        federation = settings.federation
        positions = batch_positions(len(sample_indices), federation.batch_size, federation.local_steps,
                                    federation.local_epochs, generator)
        # A straggler does the first of its planned steps: its mini-batches are those it would have had.
        positions = positions[:self.steps_done(client_id, round_index)]
        constraint, params, layout = settings.constraint, global_model.params, global_model.param_layout
        projection = None if constraint is None else constraint.projection(params, layout)
        step_projection = None if constraint is None else constraint.step_projection(params, layout)
        return ClientRound(
            client_id=client_id,
            round=round_index,
            num_samples=len(sample_indices),
            global_params=global_model.params,
            buffers=global_model.buffers.clone(),
            state=state,
            server=server,
            optimizer_args=settings.client_optimizer,
            projection=projection,
            step_projection=step_projection,
            num_steps=len(positions),
            execution=Execution(self, sample_indices, positions, generator),
        )

    # For diagnostics of the global model (fl_lightning.diagnostics.landscape).

    def training_pool(self) -> torch.Tensor:
        """The training-set indices of every client's samples together, in increasing order."""
        return torch.from_numpy(np.sort(self.samples.indices).astype(np.int64))

    def training_batch(self, indices: torch.Tensor) -> Batch:
        """The training samples at `indices`, normalised on the device and never augmented."""
        indices = indices.to(self.data.images.device)
        return self.data.transform(self.data.images[indices]), self.data.labels[indices]

    def eval_loss(self, params: torch.Tensor, buffers: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The module's training loss at flat `params` on `batch` in eval mode: BatchNorm normalises
        with the running statistics in the flat float `buffers` (left unchanged), dropout is off.
        Differentiable in `params`, by autograd and by torch.func alike (Hessian-vector products)."""
        return self._call_with_buffers(self.call, params, buffers, batch, training=False)[0]
