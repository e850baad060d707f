"""What a client's local update works with (`ClientRound`): its mini-batch stream, the loss and its
gradient at any parameters, and an explicit local SGD.

Everything a client draws comes from a generator seeded by (seed, round, client), never by rank,
so a run gives the same model on 1, 2 or 8 ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol

import numpy as np
import torch

from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.server_optimizers import ServerState

Batch = tuple[torch.Tensor, torch.Tensor]


class ClientTrainer(Protocol):
    """What a `ClientRound` asks of the rank's trainer (fl_lightning.federation.trainer.LocalTrainer):
    its batches, and the module's loss, gradient and features at flat parameters."""

    seed: int
    """The run's seed, which every client's stream of draws starts from."""
    global_buffers: torch.Tensor
    """The global model's float buffers (BatchNorm running statistics), read only."""

    def make_batches(self, sample_indices: torch.Tensor, positions: list[torch.Tensor],
                     generator: torch.Generator) -> list[Batch]: ...

    def loss_grad_and_buffers(self, params: torch.Tensor, buffers: torch.Tensor, batch: Batch, functional: bool = False,
                              client_weights: Optional[torch.Tensor] = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def loss_and_grad(self, params: torch.Tensor, buffers: torch.Tensor, batch: Batch
                      ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def features(self, params: torch.Tensor, buffers: torch.Tensor, inputs: torch.Tensor,
                 training: bool = True) -> torch.Tensor: ...


# Separate streams, so that a client's batches never share random numbers with client sampling, and
# neither shares any with who is online (participation: a stream per round, and one of the draws a
# run makes once) or whose upload is lost (dropout). Keys that differ only by trailing zeros seed the
# same stream (NumPy's SeedSequence), so a stream's keys always have one length.
SAMPLING_STREAM = 0
CLIENT_STREAM = 1
PARTICIPATION_STREAM = 2
DROPOUT_STREAM = 3
POPULATION_STREAM = 4
SPEED_STREAM = 5  # (seed, stream, client): a straggler's speed class, drawn once per run
STEPS_STREAM = 6  # (seed, stream, round, client): a straggler's jitter of the round


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator whose stream depends only on `keys` (e.g. seed, stream, round, client)."""
    state = np.random.SeedSequence([int(k) for k in keys]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


def seeded_numpy_generator(*keys: int) -> np.random.Generator:
    """A NumPy generator whose stream depends only on `keys`, as `seeded_generator`'s: for the draws that
    torch has no seeded sampler of (a Beta distribution)."""
    return np.random.default_rng(np.random.SeedSequence([int(k) for k in keys]))


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


def planned_steps(num_samples: int, federation) -> int:
    """K_i, the local steps of a client of `num_samples` samples as `batch_positions` cuts them, before
    any straggler's cut (`federation` is the run's FederationArgs)."""
    if federation.local_epochs is not None:
        return federation.local_epochs * math.ceil(num_samples / federation.batch_size)
    return federation.local_steps


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
    `project_step` (optional) maps the parameters after each step instead, as the FedCONST authors'
    code does: momentum then accumulates the unprojected directions.
    Momentum starts at zero every round, as in all reference code. `step` returns the new
    parameters rather than updating them in place, so the same code steps one client or, under
    vmap, each of a group. `active_steps` (one bool per step, grouped clients only) marks the
    steps a client of a group takes; on the others its parameters and momentum stay as they are.
    """

    def __init__(self, args: ClientOptimizerArgs, project: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 active_steps: Optional[torch.Tensor] = None,
                 project_step: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.args = args
        self.project = project
        self.project_step = project_step
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
        if self.project_step is not None:
            new_params = self.project_step(new_params)
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
class Execution:
    """How a `ClientRound`'s passes are computed: by which trainer, on which of the client's samples
    in which order, and, in a group (`fl_lightning.federation.groups`), how: under `torch.func.vmap`
    (`vectorised`, with `active_steps`) or fused (`client_weights`). Made by `LocalTrainer.client_round`
    and by the grouped path; algorithms never read it."""

    trainer: ClientTrainer
    """The rank's trainer that built the round (shared by the round's clients on this rank)."""
    sample_indices: torch.Tensor
    """The client's training-set indices."""
    positions: list[torch.Tensor]
    """Each local step's places in `sample_indices`."""
    generator: torch.Generator
    """The client's stream of the round; its batches' augmentations are drawn from it."""
    batches: Optional[list[Batch]] = None
    """The batches, once made (a group's are given, stacked)."""
    vectorised: bool = False
    """One client of a group under `torch.func.vmap`: its tensors are its slices of the group's."""
    client_weights: Optional[torch.Tensor] = None
    """Set when the run stands for a group of clients fused into one (`Algorithm.fuses_clients`):
    their weights, summing to 1. Its buffers, batches and losses are then the group's, stacked per
    client, and each gradient it takes is the weighted mean of the clients' gradients, each at the
    same parameters on its own batch."""
    active_steps: Optional[torch.Tensor] = None
    """In a group whose clients differ in steps: which steps this client takes (`LocalSGD`)."""

    def made_batches(self) -> list[Batch]:
        """The batches, made on first use (see `ClientRound.batches`)."""
        if self.batches is None:
            self.batches = self.trainer.make_batches(self.sample_indices, self.positions, self.generator)
        return self.batches


@dataclass
class ClientRound:
    """One client's share of one round.

    Algorithms read and write it the same way whether it runs alone or, in the grouped path, as
    one of a group under `torch.func.vmap`: then every tensor below is one client's slice of the
    group's, and the code must stay tensor arithmetic (no `.item()`, no branching on values)."""

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
    server: ServerState
    """The server's state as the round began (read only): its tensors (SCAFFOLD's control, CTP-FL's
    direction) and the server optimizer the run steps with."""
    optimizer_args: ClientOptimizerArgs
    projection: Optional[Callable[[torch.Tensor], torch.Tensor]]
    """The round's constraint projection of local directions (FedCONST), or None."""
    step_projection: Optional[Callable[[torch.Tensor], torch.Tensor]]
    """The round's constraint map of the parameters after each local step (FedCONST as its authors'
    code runs it), or None."""
    num_steps: "int | torch.Tensor"
    """Local steps this round: K_i (a tensor when grouped clients differ in it)."""
    execution: Execution
    """How its passes are computed (the trainer's and the grouped path's business, not an algorithm's)."""
    losses: list[torch.Tensor] = field(default_factory=list)
    """The training loss of each training pass so far."""

    def batches(self) -> Iterator[Batch]:
        """The client's `num_steps` mini-batches, augmented and normalised on the device; all made
        on first use, so no step waits on a transfer from the host, and kept: a diagnostic that
        looks at them after the update gets the very batches it trained on, drawing nothing."""
        return iter(self.execution.made_batches())

    def loss_and_grad(self, params: torch.Tensor, batch: Batch, training_pass: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's training loss at flat `params` on `batch`, and its gradient (flat).

        A training pass updates this client's BatchNorm running statistics and counts towards its
        train loss; an extra evaluation on the same batch (FedSAM's ascent point) does neither."""
        execution = self.execution
        loss, gradient, buffers = execution.trainer.loss_grad_and_buffers(
            params, self.buffers, batch, execution.vectorised, execution.client_weights)
        if training_pass:
            self.buffers = buffers
            self.losses.append(loss)
        return loss, gradient

    def gradient(self, function: Callable[[torch.Tensor], torch.Tensor], params: torch.Tensor) -> torch.Tensor:
        """The gradient of the scalar `function` at `params` (autograd alone, torch.func in a group)."""
        return differentiate(function, params, self.execution.vectorised)[0]

    def features(self, params: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The network's `forward_features` at flat `params` on `inputs`, differentiable in `params`;
        computed as in training, without touching this client's running statistics."""
        return self.execution.trainer.features(params, self.buffers, inputs)

    def frozen_features(self, params: torch.Tensor, buffers: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """`forward_features` of a fixed model (flat `params` and float `buffers`) on `inputs` in eval
        mode, without gradients: BatchNorm normalises with the running statistics in `buffers` (left
        unchanged), dropout is off."""
        with torch.no_grad():
            return self.execution.trainer.features(params, buffers, inputs, training=False)

    @property
    def batch_sizes(self) -> list[int]:
        return [len(positions) for positions in self.execution.positions]

    def local_sgd(self) -> LocalSGD:
        """A fresh local optimizer (momentum reset) that applies the round's constraint, if any."""
        return LocalSGD(self.optimizer_args, self.projection, self.execution.active_steps, self.step_projection)

    @property
    def mean_loss(self) -> torch.Tensor:
        """The mean training loss of the client's steps, left on the device (no host sync)."""
        return torch.stack(self.losses).mean()

    # For diagnostics, which look at a client after its update (`on_client_end`), one at a time.

    def gradient_at(self, params: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The training loss's gradient at flat `params` on `batch`, taken as a local step takes it
        (train mode: BatchNorm normalises with the batch's statistics) from the global model's
        buffers; this client's buffers and losses stay as they are. E.g. the gradient at the
        global model on a batch the client trained on (`batches`)."""
        trainer = self.execution.trainer
        return trainer.loss_and_grad(params, trainer.global_buffers, batch)[1]

    def generator(self, stream: int) -> torch.Generator:
        """A generator for the client's draws of this round in `stream`, seeded by (the run's seed,
        `stream`, round, client) as its training stream is (`CLIENT_STREAM`): the same on any number
        of ranks, and advancing no stream of training. Streams from 1000 up are the diagnostics'."""
        return seeded_generator(self.execution.trainer.seed, stream, self.round, self.client_id)

    def draw_batches(self, positions: list[torch.Tensor], generator: torch.Generator) -> list[Batch]:
        """Batches of the client's own samples: one per tensor of `positions` (places in its sample
        list, 0 to `num_samples` - 1), augmented from `generator` and normalised on the device as its
        training batches are."""
        execution = self.execution
        return execution.trainer.make_batches(execution.sample_indices, positions, generator)


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
