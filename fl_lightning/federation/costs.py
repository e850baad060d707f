"""A run's counters of what its clients spent, cumulative round by round, from each algorithm's declared
cost (`Algorithm.cost`, `fl_lightning.algorithms.costs`): metrics.jsonl's, the W&B history's and the
checkpoint's `cost_*` keys.

Everything but the seconds is counted from the round's draws alone (who was drawn and who reported,
each client's local steps), the same on every rank, for any number of ranks, on either client path and
after a resume, which replays the draws of the rounds before it. What a deployment spends:

- a drawn client trains (a dropped one too: its upload is lost after it trained) and receives the model,
  its BatchNorm statistics and the server tensors its method sends down;
- a client whose upload reached the server sent its model-sized vectors, the BatchNorm statistics and
  its short uploads (`Algorithm.weighted_short_uploads`, `summed_short_uploads`) at their length, each at the
  dtype of the model's parameters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Callable, Optional

import numpy as np
import torch

from fl_lightning.algorithms import Algorithm
from fl_lightning.config import FederationArgs
from fl_lightning.federation.aggregation import RoundClients, round_clients
from fl_lightning.metric_names import COST_COUNTERS
from fl_lightning.server_optimizers import ServerOptimizer, ServerState

COUNTERS = COST_COUNTERS
"""The keys of a round's metrics row that count what the run spent up to the end of that round."""
SAMPLES, GRAD_EVALS, FORWARD_PASSES, UPLOAD_BYTES, DOWNLOAD_BYTES, CLIENT_SECONDS = COUNTERS


def seconds_since(started: float, device: torch.device) -> float:
    """The seconds since `started` (`time.perf_counter`), the work queued on a GPU done first."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def samples_of_steps(num_samples: int, steps: int, federation: FederationArgs) -> int:
    """The training examples of a client's first `steps` local steps, as `batch_positions` cuts them:
    batches of B, an epoch of `local_epochs` ending on its remainder."""
    if federation.local_epochs is None:
        return steps * federation.batch_size
    full_epochs, steps_into_epoch = divmod(steps, -(-num_samples // federation.batch_size))
    return full_epochs * num_samples + steps_into_epoch * federation.batch_size


class ModelSizes:
    """The bytes of what goes over the wire, from the flat global model and the server's state."""

    def __init__(self, algorithm: Algorithm, params, buffers, server: ServerState):
        self.element = params.element_size()
        self.model = params.numel() * self.element
        self.buffers = buffers.numel() * buffers.element_size()
        cost = algorithm.cost
        self.sent_down = sum(self.tensor(server, name) for name in cost.sent_down)
        self.rebuilt_down = sum(self.tensor(server, name) for name in cost.rebuilt_down)
        self.upload = (cost.uploads * self.model + self.buffers
                       + short_upload_elements(algorithm) * self.element)

    @staticmethod
    def tensor(server: ServerState, name: str) -> int:
        tensor = server.tensors[name]
        return tensor.numel() * tensor.element_size()


class RunCosts:
    """The counters of one run on one rank; `after_round` adds a round's and returns them."""

    def __init__(self, algorithm: Algorithm, server_optimizer: ServerOptimizer, federation: FederationArgs,
                 seed: int, client_sizes: Sequence[int], steps_done: Callable[[int, int], int], sizes: ModelSizes):
        self.algorithm, self.server_optimizer, self.sizes = algorithm, server_optimizer, sizes
        self.federation, self.seed, self.client_sizes, self.steps_done = federation, seed, client_sizes, steps_done
        self.totals: Optional[dict[str, float]] = dict.fromkeys(COUNTERS, 0)
        # A flag a client rather than a set of them: a million clients cost a megabyte.
        self.reported_before = np.zeros(federation.num_clients, dtype=bool)
        self.last_step: Optional[tuple[np.ndarray, bool]] = None
        """The clients drawn in the round of the server's last step (a flag a client), and whether those
        that reported took equal local steps; None before the first step."""

    def resume(self, history: list[dict]) -> None:
        """The counters at the end of `history`'s last round (a checkpoint's), and the draws before it.
        A history logged before the counters existed gives no counters for the rest of the run: counting
        from zero would be silently wrong."""
        if not history:
            return
        if any(key not in history[-1] for key in COUNTERS):
            self.totals = None
            return
        self.totals = {key: history[-1][key] for key in COUNTERS}
        for round_index in range(history[-1]["round"]):
            self._remember(round_index, round_clients(self.seed, round_index, self.federation))

    def after_round(self, round_index: int, taking_part: RoundClients, client_seconds: float) -> dict[str, float]:
        """The counters at the end of the round (none when unknown), the round's cost added."""
        if self.totals is not None:
            totals = self.totals
            for client in taking_part.drawn:
                steps = self.steps_done(client, round_index)
                passes = self.algorithm.step_passes(bool(self.reported_before[client]))
                totals[SAMPLES] += samples_of_steps(int(self.client_sizes[client]), steps, self.federation)
                totals[GRAD_EVALS] += passes.backward * steps
                totals[FORWARD_PASSES] += passes.forward * steps
                totals[DOWNLOAD_BYTES] += self._download(client)
            totals[UPLOAD_BYTES] += self.sizes.upload * len(taking_part.reported)
            totals[CLIENT_SECONDS] += client_seconds
        self._remember(round_index, taking_part)
        return {} if self.totals is None else dict(self.totals)

    def _download(self, client: int) -> int:
        sizes, last_step = self.sizes, self.last_step
        rebuilt = last_step is None or (last_step[0][client]
                                        and self.algorithm.rebuilds_from_models(self.server_optimizer, last_step[1]))
        return sizes.model + sizes.buffers + sizes.sent_down + (0 if rebuilt else sizes.rebuilt_down)

    def _remember(self, round_index: int, taking_part: RoundClients) -> None:
        if not taking_part.reported:  # no server step: the model and the server's tensors stay as they were
            return
        steps = {self.steps_done(client, round_index) for client in taking_part.reported}
        drawn = np.zeros(self.federation.num_clients, dtype=bool)
        drawn[taking_part.drawn] = True
        self.last_step = (drawn, len(steps) == 1)
        self.reported_before[taking_part.reported] = True


def short_upload_elements(algorithm: Algorithm) -> int:
    """How many numbers a client uploads beside its model-sized vectors."""
    return sum(algorithm.weighted_short_uploads.values()) + sum(algorithm.summed_short_uploads.values())
