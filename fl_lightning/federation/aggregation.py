"""A round's clients and their aggregation: who takes part (the same draw on every rank, for any
number of ranks), which rank computes each, with what weight, and the one flat buffer that one
all-reduce(sum) aggregates, stop requests riding on it."""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fl_lightning.algorithms import Algorithm
from fl_lightning.clients.run import (
    DROPOUT_STREAM,
    PARTICIPATION_STREAM,
    POPULATION_STREAM,
    SAMPLING_STREAM,
    SPEED_STREAM,
    STEPS_STREAM,
    seeded_generator,
    seeded_numpy_generator,
)
from fl_lightning.config import FederationArgs
from fl_lightning.metric_names import CLIENTS_DRAWN, CLIENTS_DROPPED, CLIENTS_ONLINE, CLIENTS_REPORTED
from fl_lightning.participation import Draws


def sample_clients(seed: int, round_index: int, num_clients: int, clients_per_round: int) -> list[int]:
    """The round's clients when all are online: the same draw on every rank and for any number of ranks."""
    return draw_from(list(range(num_clients)), seed, round_index, clients_per_round)


def draw_from(online: Sequence[int], seed: int, round_index: int, clients_per_round: int) -> list[int]:
    """`clients_per_round` of the `online` clients (all of them when fewer are), uniformly without
    replacement, ascending; with every client online, the draw the rounds always made."""
    generator = seeded_generator(seed, SAMPLING_STREAM, round_index)
    chosen = torch.randperm(len(online), generator=generator)[:clients_per_round].tolist()
    if online != range(len(online)):  # every client online: the positions are the clients
        chosen = [online[i] for i in chosen]
    chosen.sort()
    return chosen


@dataclass(frozen=True)
class RoundClients:
    """Who took part in a round: online (`federation.participation`), drawn from them, and of those
    drawn, the ones whose upload reached the server (`federation.dropout`)."""

    online: Sequence[int]
    drawn: list[int]
    reported: list[int]

    @property
    def dropped(self) -> list[int]:
        if len(self.reported) == len(self.drawn):  # the reported are drawn: none dropped
            return []
        return sorted(set(self.drawn) - set(self.reported))

    def counts(self) -> dict[str, int]:
        """The round's metrics of who took part."""
        return {CLIENTS_ONLINE: len(self.online), CLIENTS_DRAWN: len(self.drawn),
                CLIENTS_REPORTED: len(self.reported), CLIENTS_DROPPED: len(self.dropped)}


def round_clients(seed: int, round_index: int, federation: FederationArgs) -> RoundClients:
    """The round's clients, from streams of their own seeded by (seed, round[, client]): the same on every
    rank, for any number of ranks and after a resume, and drawing nothing from the data's or the
    mini-batches' streams."""
    online = federation.online_clients.online(round_index, federation.num_clients, participation_draws(seed))
    drawn = draw_from(online, seed, round_index, federation.clients_per_round)
    if not federation.dropout:  # the same list: a round of 50,000 clients is not copied
        return RoundClients(online, drawn, drawn)
    return RoundClients(online, drawn, [c for c in drawn if not is_dropped(seed, round_index, c, federation.dropout)])


def participation_draws(seed: int) -> Draws:
    """The participation model's generators: `draws(round)` a round's, `draws()` the run's draws made once."""
    def draws(*round_index: int) -> np.random.Generator:
        if round_index:
            return seeded_numpy_generator(seed, PARTICIPATION_STREAM, *round_index)
        return seeded_numpy_generator(seed, POPULATION_STREAM)

    return draws


def is_dropped(seed: int, round_index: int, client: int, dropout: float) -> bool:
    """Whether the client's upload of the round is lost (probability `dropout`, a draw of its own)."""
    return dropout > 0 and seeded_numpy_generator(seed, DROPOUT_STREAM, round_index, client).random() < dropout


def aggregation_weights(clients: list[int], sizes: Sequence[int], weighting: str) -> ClientWeights:
    """Each client's weight; `sizes`, every client's number of samples (a list, or an array of a million
    clients), taken as Python ints: the same floats whatever holds them."""
    return ClientWeights(clients, sizes, weighting)


class ClientWeights(Mapping):
    """A round's clients (ascending, as a round draws them) -> their aggregation weights, each computed
    when asked for (the same float a dict of them would hold) rather than held: a dict of a round of
    50,000 clients takes some 4 MB."""

    def __init__(self, clients: list[int], sizes: Sequence[int], weighting: str):
        self.clients, self.sizes, self.weighting = clients, sizes, weighting
        self._total = len(clients) if weighting == "uniform" else sum(int(sizes[c]) for c in clients)

    def __getitem__(self, client: int) -> float:
        if client not in self:
            raise KeyError(client)
        return 1.0 / self._total if self.weighting == "uniform" else int(self.sizes[client]) / self._total

    def __contains__(self, client: object) -> bool:
        position = bisect.bisect_left(self.clients, client)
        return position < len(self.clients) and self.clients[position] == client

    def __iter__(self) -> Iterator[int]:
        return iter(self.clients)

    def __len__(self) -> int:
        return len(self.clients)


def clients_of_rank(clients: list[int], rank: int, world_size: int, stateful: bool) -> list[int]:
    """Stateful clients stay with their owner rank (client id mod world size), where their state
    lives; stateless clients are dealt round-robin so ranks get nearly equal shares."""
    if world_size == 1:  # all of them: no copy of a round of 50,000 clients
        return clients
    if stateful:
        return [c for c in clients if c % world_size == rank]
    return clients[rank::world_size]


STOP_REQUESTED = "stop_requested"
REQUEUE_REQUESTED = "requeue_requested"
CLIENT_SECONDS = "client_seconds"
"""The seconds the ranks spent computing their clients' updates, summed (the run's `cost_client_seconds`)."""


def stop_vote(asked_final: list[bool], world_size: int) -> int:
    """A rank's entry in the stop slot: 0 when it asks nothing, 1 for an interruption, and more than
    every rank's interruptions together for a final stop, so that the slot's sum over the ranks says
    both whether any rank asked to stop (> 0) and whether any asked for a final stop (`is_final_vote`)."""
    if not asked_final:
        return 0
    return world_size + 1 if any(asked_final) else 1


def is_final_vote(total: float, world_size: int) -> bool:
    return total > world_size


class UploadBuffer:
    """The flat buffer one all-reduce sums: weighted uploads (model-sized and short), float buffers, summed
    uploads (model-sized and short), the
    weighted training loss, the ranks' stop votes (`stop_vote`), the number of ranks asked to requeue (a
    preemption signal) and the seconds of the ranks' client updates, in that order. Riding on the
    aggregation, a stop request needs no collective of its own."""

    def __init__(self, algorithm: Algorithm, num_params: int, num_buffers: int, device: torch.device):
        self.sections: list[tuple[str, int, bool]] = (
            [(name, num_params, True) for name in algorithm.weighted_uploads]
            + [(name, size, True) for name, size in algorithm.weighted_short_uploads.items()]
            + [("buffers", num_buffers, True)]
            + [(name, num_params, False) for name in algorithm.summed_uploads]
            + [(name, size, False) for name, size in algorithm.summed_short_uploads.items()]
            + [("train_loss", 1, True), (STOP_REQUESTED, 1, False), (REQUEUE_REQUESTED, 1, False),
               (CLIENT_SECONDS, 1, False)]
        )
        self.flat = torch.zeros(sum(size for _, size, _ in self.sections), device=device)
        self._views = dict(zip([n for n, _, _ in self.sections], self.flat.split([s for _, s, _ in self.sections])))
        self._weighted = {n for n, _, w in self.sections if w}

    def add(self, values: dict[str, torch.Tensor], weight: float) -> None:
        for name, value in values.items():
            self._views[name].add_(value, alpha=weight if name in self._weighted else 1.0)

    def reduced(self, engine) -> dict[str, torch.Tensor]:
        total = engine.all_reduce(self.flat, reduce_op="sum") if engine.world_size > 1 else self.flat
        return dict(zip([n for n, _, _ in self.sections], total.split([s for _, s, _ in self.sections])))


def local_steps_done(seed: int, round_index: int, client: int, federation: FederationArgs, planned: int) -> int:
    """The local steps the client does in the round of its `planned` K_i (`federation.stragglers`), from its
    own draws: its speed class of the run and its jitter of the round."""
    if federation.stragglers is None:
        return planned
    return federation.stragglers.steps(planned, seeded_numpy_generator(seed, SPEED_STREAM, client),
                                       seeded_numpy_generator(seed, STEPS_STREAM, round_index, client))
