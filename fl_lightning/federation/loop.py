"""The round loop: the one module that knows about ranks and the all-reduce.

Every rank holds the global model and server state. Each round, the sampled clients are split
over the ranks; each rank runs its clients' updates and adds their weighted uploads into one flat
buffer; one all-reduce(sum) aggregates; every rank then applies the same server rule. Everything
around the rounds (evaluation, checkpoints, logs, stops) is a callback (`fl_lightning.callbacks`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Optional

import numpy as np
import torch

from fl_lightning.callbacks import Callback, callback_states, load_callback_states
from fl_lightning.checkpoint import (
    CALLBACKS,
    CLIENT_INDEX,
    FINAL_STOP,
    PARTITION_DIGEST,
    PENDING_FINAL_STOPS,
    VALIDATION_DIGEST,
    checkpoint_rounds,
    last_good_checkpoint,
    save_checkpoint,
)
from fl_lightning.data import DeviceTransform
from fl_lightning.federation.aggregation import (
    CLIENT_SECONDS,
    REQUEUE_REQUESTED,
    STOP_REQUESTED,
    UploadBuffer,
    aggregation_weights,
    clients_of_rank,
    is_final_vote,
    round_clients,
    stop_vote,
)
from fl_lightning.federation.client_paths import ClientPath
from fl_lightning.federation.client_store import ClientStates
from fl_lightning.federation.costs import ModelSizes, RunCosts, seconds_since
from fl_lightning.federation.evaluation import Evaluation
from fl_lightning.federation.global_state import FlatGlobalModel
from fl_lightning.federation.groups import client_updates, normalise_batches_in_float32
from fl_lightning.federation.setup import RankInputs
from fl_lightning.federation.trainer import LocalTrainer, TrainingData
from fl_lightning.host_memory import release_free_heap
from fl_lightning.lost_ranks import RankProcesses
from fl_lightning.metric_names import STEPS_MEAN, STEPS_MIN


class FederatedLoop:
    """One rank's federation: the global model, the server's state, the clients this rank owns,
    and the rounds run so far. Callbacks get it as `loop`; what they may use of it:

    - the run: `inputs` (the RankInputs: `inputs.settings`, the whole RunSettings, `inputs.data`),
      `hyperparameters` (as config.yaml records them), `out_dir`, `rounds` (asked for), `start_round`
      (0, or the round resumed from), `history` (one metrics row per round; `completed_rounds`);
    - the model: `module`, `global_model` (its flat parameters and buffers), `algorithm` (the
      configured one: hyper-parameters), `server_state` (the run's `ServerState`: the algorithm's
      server tensors, the server optimizer and its state), `client_states` (this rank's clients'
      state, for stateful algorithms: `stateful`);
    - the rank's clients and evaluation: `trainer` (a training batch, the loss at flat parameters),
      `client_path`, `evaluation` (test batches) and `evaluate()`;
    - stops: `request_stop(reason, ...)`, `stopping`, `stopped_early`, `final_stop`,
      `requeue_agreed`, `stop_reasons`, and after a failure `failure` / `failed`;
    - `save_checkpoint()` (collective) and `run_round(i)` (what the benchmarks time).
    The rest is the loop's own."""

    def __init__(self, engine, inputs: RankInputs):
        settings = inputs.settings
        self.engine, self.inputs = engine, inputs
        self.rounds, self.out_dir = settings.federation.rounds, inputs.out_dir
        self.hyperparameters = inputs.hyperparameters
        device = engine.device
        self.module = engine.to_device(inputs.module)
        self.global_model = FlatGlobalModel.bind(self.module, device)
        self.algorithm = settings.algorithm
        self.server_state = self.algorithm.setup(inputs.server_optimizer, self.global_model.param_layout.numel,
                                                 settings.federation.num_clients, device)
        state = inputs.resume_state
        self.start_round = 0 if state is None else state["round"]
        self.history: list[dict] = [] if state is None else list(state["metrics"])
        if state is not None:
            self.module.load_state_dict(state["model"])
            self.server_state.load_state_dict(state["algorithm"], device)
        self.stateful = bool(self.algorithm.client_state)
        self.client_states = ClientStates.resumed(
            self.out_dir, settings.compute.client_state_memory_mib * 2**20, self.start_round,
            {} if state is None else state["client_states"], engine.global_rank, engine.world_size,
            [] if state is None else state.get(CLIENT_INDEX), settings.federation.num_clients)
        self.trainer = self._local_trainer(device)
        self._sizes = inputs.data.partition.sizes
        self.costs = RunCosts(self.algorithm, self.server_state.optimizer, settings.federation, settings.seed,
                              self._sizes, self.trainer.steps_done,
                              ModelSizes(self.algorithm, self.global_model.params, self.global_model.buffers,
                                         self.server_state))
        self.costs.resume(self.history)
        self.client_path = ClientPath.of(settings.compute, self.algorithm, device, settings.federation.batch_size)
        if self.client_path.grouped:
            normalise_batches_in_float32(self.module)
        self.evaluation = Evaluation(engine, self.module, inputs.data.test, self.trainer.data, inputs.data.validation,
                                     settings.federation.eval_batch_size, settings.data.per_client_eval)
        self._weighting = settings.federation.weighting or self.algorithm.default_weighting
        self.stop_reasons: set[str] = set()  # every stop this process asked for
        self._asked_since_aggregation: dict[str, bool] = {}  # reason -> whether final, for the next aggregation
        self._requeue_requested = False
        self.stopping = self.requeue_agreed = False
        self.failure: Optional[BaseException] = None  # what ended the run, when it failed
        self.final_stop: Optional[str] = None  # the reasons of an agreed final stop
        if state is not None:
            # A final stop asked for after the checkpoint's round still rides the next aggregation,
            # as it would have without the interruption.
            for reason in state.get(PENDING_FINAL_STOPS, []):
                self.request_stop(reason, final=True)
            load_callback_states(self.callbacks, state.get(CALLBACKS, {}), f"the checkpoint of round {state['round']}")

    def _local_trainer(self, device: torch.device) -> LocalTrainer:
        settings, train = self.inputs.settings, self.inputs.data.train
        data = TrainingData(train.images.to(device), train.labels.to(device),
                            DeviceTransform(train.mean, train.std, augment=settings.data.augment,
                                            crop_padding=settings.data.crop_padding))
        return LocalTrainer(self.engine, self.module, data, self.global_model, self.inputs.data.partition, settings)

    @property
    def completed_rounds(self) -> int:
        return self.history[-1]["round"] if self.history else 0

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def stopped_early(self) -> bool:
        return self.stopping and self.completed_rounds < self.rounds

    @property
    def callbacks(self) -> list[Callback]:
        """The run's callbacks, in the order Fabric calls them."""
        # Fabric keeps the callbacks it calls in `_callbacks` and has no public accessor.
        return [callback for callback in self.engine._callbacks if isinstance(callback, Callback)]

    def request_stop(self, reason: str, requeue: bool = False, final: Optional[bool] = None) -> None:
        """Ask the run to stop after the round whose aggregation comes next (see fl_lightning.callbacks).

        A final stop (a decision: early stopping, a target reached) is recorded in the checkpoint, and
        the same command run again trains nothing more; an interruption (`final=False`: a signal, a
        time budget) is resumed by it. Unset, `final` is true unless the stop asks for a requeue,
        which exists to resume the run."""
        final = not requeue if final is None else final
        if final and requeue:
            raise ValueError(f"stop {reason!r}: a final stop cannot ask for a requeue (a requeued job resumes the run)")
        self.stop_reasons.add(reason)
        self._asked_since_aggregation[reason] = self._asked_since_aggregation.get(reason, False) or final
        self._requeue_requested = self._requeue_requested or requeue

    def run_round(self, round_index: int) -> dict:
        """One round: sample, train this rank's clients, aggregate in one all-reduce, step the
        server. Returns the round's metrics row (also appended to `history`)."""
        started = time.perf_counter()
        engine, settings, algorithm = self.engine, self.inputs.settings, self.algorithm
        federation = settings.federation
        taking_part = round_clients(settings.seed, round_index, federation)
        # Only the uploads that reach the server count, their weights renormalised over them; a dropped
        # client's training reaches neither the server nor its own state, and is not computed.
        clients = taking_part.reported
        weights = aggregation_weights(clients, self._sizes, self._weighting)
        buffer = UploadBuffer(algorithm, self.global_model.param_layout.numel, self.global_model.buffer_layout.numel,
                              engine.device)
        hooks_seconds = 0.0  # diagnostics' time on their rounds, left out of the round's own time
        self.client_states.round_completed = round_index + 1
        if self.stateful:
            self.client_states.read_ahead(self._clients_ahead(clients, round_index))
        clients_started = time.perf_counter()
        runs = self._client_rounds(clients, round_index)
        for client, contribution, uploads in client_updates(algorithm, runs, self.client_path, weights):
            if self.stateful:
                self.client_states.put(client.client_id, client.state)
            hook_started = time.perf_counter()
            # A fused client's own uploads are computed here, if a callback reads them: its cost.
            engine.call("on_client_end", engine, self, client, uploads, weights[client.client_id])
            hooks_seconds += time.perf_counter() - hook_started
            buffer.add({**contribution, "buffers": client.buffers, "train_loss": client.mean_loss.reshape(1)},
                       weights[client.client_id])
        client_seconds = seconds_since(clients_started, engine.device) - hooks_seconds
        buffer.add({CLIENT_SECONDS: torch.full((1,), client_seconds, device=engine.device)}, 1.0)
        asked, self._asked_since_aggregation = self._asked_since_aggregation, {}
        vote = stop_vote(list(asked.values()), engine.world_size)
        one = torch.ones(1, device=engine.device)
        buffer.add({**({STOP_REQUESTED: vote * one} if vote else {}),
                    **({REQUEUE_REQUESTED: one} if self._requeue_requested else {})}, 1.0)
        aggregate = buffer.reduced(engine)
        self._check_finite(round_index, clients, "the aggregated update of clients",
                           [aggregate[name] for name in algorithm.weighted_uploads + algorithm.summed_uploads])
        if clients:  # a round in which no upload arrived leaves the model and the server's state as they were
            algorithm.server_update(self.server_state, self.global_model.params, aggregate)
            self.global_model.buffers.copy_(aggregate["buffers"])
        # Checked before anything is saved: a non-finite model must never become "the last good checkpoint".
        self._check_finite(round_index, clients, "the global model after the server step of clients",
                           [self.global_model.params, self.global_model.buffers])
        votes = aggregate[STOP_REQUESTED].item()
        self.stopping = votes > 0
        if is_final_vote(votes, engine.world_size):
            self.final_stop = "; ".join(sorted(r for r, final in asked.items() if final)) or "requested by another rank"
        # A run stopped for good is not requeued: the requeued job would have nothing to train.
        self.requeue_agreed = aggregate[REQUEUE_REQUESTED].item() > 0 and self.final_stop is None
        metrics = {"round": round_index + 1,
                   "train_loss": aggregate["train_loss"].item() if clients else float("nan"),
                   **algorithm.round_metrics(self.server_state), **taking_part.counts(),
                   **self._steps_done(clients, round_index),
                   **self.costs.after_round(round_index, taking_part, aggregate[CLIENT_SECONDS].item()),
                   "round_seconds": time.perf_counter() - started - hooks_seconds}
        self.history.append(metrics)
        release_free_heap()
        return metrics

    def _steps_done(self, clients: list[int], round_index: int) -> dict[str, float]:
        """The local steps the reporting clients did (`federation.stragglers`): their mean and least."""
        if not clients:
            return {STEPS_MEAN: float("nan"), STEPS_MIN: float("nan")}
        steps = np.fromiter((self.trainer.steps_done(client, round_index) for client in clients), dtype=np.int64,
                            count=len(clients))  # not a list of 50,000 Python ints
        return {STEPS_MEAN: int(steps.sum()) / len(clients), STEPS_MIN: int(steps.min())}

    def _clients_ahead(self, clients: list[int], round_index: int) -> Iterator[int]:
        """This rank's clients of the round, then those of the next round (drawn once this round's are
        all being read): the order in which their states will be asked for."""
        engine, settings = self.engine, self.inputs.settings
        yield from clients_of_rank(clients, engine.global_rank, engine.world_size, self.stateful)
        if round_index + 1 < self.rounds:
            later = round_clients(settings.seed, round_index + 1, settings.federation).reported
            yield from clients_of_rank(later, engine.global_rank, engine.world_size, self.stateful)

    def _client_rounds(self, clients: list[int], round_index: int):
        """This rank's clients of the round, each set up only when the algorithm asks for it."""
        engine = self.engine
        for client_id in clients_of_rank(clients, engine.global_rank, engine.world_size, self.stateful):
            yield self.trainer.client_round(client_id, round_index, self.client_states.get(client_id, engine.device),
                                            self.server_state)

    def _check_finite(self, round_index: int, clients: list[int], what: str, tensors: list[torch.Tensor]) -> None:
        if all(torch.isfinite(t).all() for t in tensors):
            return
        saved = last_good_checkpoint(self.out_dir)
        last_good = "no checkpoint was saved yet" if saved is None else f"the last good checkpoint is {saved}"
        raise FloatingPointError(f"round {round_index + 1}: {what} {clients} is not finite (NaN or inf; is a "
                                 f"learning rate too large?); {last_good}")

    def evaluate(self) -> dict[str, float]:
        """The global model's metrics now (`Evaluation.metrics`; collective: every rank calls it)."""
        return self.evaluation.metrics()

    def save_checkpoint(self) -> None:
        """The state after the last completed round (collective: every rank calls it)."""
        engine, completed, data = self.engine, self.completed_rounds, self.inputs.data
        if self.stateful:
            self.client_states.checkpoint(completed, engine.world_size)
            engine.barrier()  # every index delta is on disk before the main file marks the checkpoint complete
        if engine.global_rank == 0:
            save_checkpoint({
                "round": completed,
                "model": {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()},
                "algorithm": self.server_state.state_dict(),
                PARTITION_DIGEST: data.partition.digest(),
                VALIDATION_DIGEST: None if data.validation is None else data.validation.digest(),
                "run_id": self.inputs.run_id,
                CLIENT_INDEX: self.client_states.index_deltas,
                "rng": torch.get_rng_state(),
                "hyperparameters": self.hyperparameters,
                "metrics": self.history,
                FINAL_STOP: self.final_stop,
                PENDING_FINAL_STOPS: sorted(r for r, final in self._asked_since_aggregation.items() if final),
                CALLBACKS: callback_states(self.callbacks),
            }, self.out_dir, self.inputs.settings.checkpoint.keep)
        engine.barrier()
        if self.stateful:  # rank 0 has pruned the checkpoints: the client-state files none refers to go
            self.client_states.pruned(checkpoint_rounds(self.out_dir))


def train(engine, inputs: RankInputs) -> None:
    """Run the federation on `engine`, the run's Lightning Fabric (its ranks, devices and collectives),
    calling the callbacks given to it around every round; the final global model is the last
    checkpoint. A collective that fails because another rank is gone raises RankLost, naming it."""
    loop = FederatedLoop(engine, inputs)
    ranks = RankProcesses.gather(engine)  # now: a rank gone later cannot say who it was
    engine.call("on_fit_start", engine, loop)
    try:
        for round_index in range(loop.start_round, loop.rounds):
            engine.call("on_round_start", engine, loop, round_index)
            metrics = loop.run_round(round_index)
            engine.call("on_round_end", engine, loop, metrics)
            if loop.stopping:
                break
    except BaseException as err:
        lost = ranks.lost(err, round_index + 1)
        loop.failure = lost or err
        if lost is not None:
            raise lost from err
        raise
    finally:
        engine.call("on_fit_end", engine, loop)
