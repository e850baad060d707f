"""The round loop: the one module that knows about ranks and the all-reduce.

Every rank holds the global model and server state. Each round, the sampled clients are split
over the ranks; each rank runs its clients' updates and adds their weighted uploads into one flat
buffer; one all-reduce(sum) aggregates; every rank then applies the same server rule. Everything
around the rounds (evaluation, checkpoints, logs, stops) is a callback (`fl_lightning.callbacks`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fl_lightning.algorithms import Algorithm
from fl_lightning.callbacks import Callback, callback_states, load_callback_states
from fl_lightning.checkpoint import (
    CALLBACKS,
    FINAL_STOP,
    PENDING_FINAL_STOPS,
    last_good_checkpoint,
    save_checkpoint,
    save_client_shard,
)
from fl_lightning.clients.groups import client_updates, normalise_batches_in_float32
from fl_lightning.clients.paths import ClientPath
from fl_lightning.clients.run import SAMPLING_STREAM, seeded_generator
from fl_lightning.clients.trainer import LocalSettings, LocalTrainer, TrainingData
from fl_lightning.config import ClientOptimizerArgs, ComputeArgs, DataArgs, FederationArgs
from fl_lightning.constraints import Constraint
from fl_lightning.data import DeviceTransform, ImageDataset
from fl_lightning.flat import FlatLayout
from fl_lightning.lost_ranks import RankProcesses
from fl_lightning.metric_names import (
    CLIENT_VAL_ACCURACY_MEAN,
    CLIENT_VAL_ACCURACY_MIN,
    CLIENT_VAL_ACCURACY_P10,
    CLIENT_VAL_ACCURACY_STD,
    VAL_ACCURACY,
    VAL_LOSS,
)
from fl_lightning.module import ClassificationModule
from fl_lightning.server_optimizers import ServerOptimizer


@dataclass
class FederatedRun:
    """Everything a rank needs to run the federation (picklable, for spawned ranks)."""

    algorithm: Algorithm
    server_optimizer: ServerOptimizer
    module: ClassificationModule
    train: ImageDataset
    test: ImageDataset
    partition: list[np.ndarray]
    federation: FederationArgs
    data: DataArgs
    client_optimizer: ClientOptimizerArgs
    checkpoint_keep: int
    seed: int
    out_dir: Path
    run_id: str
    hyperparameters: dict
    constraint: Optional[Constraint] = None
    resume_state: Optional[dict] = None
    compute: ComputeArgs = field(default_factory=ComputeArgs)
    validation: Optional[list[np.ndarray]] = None
    """Each client's held-out training-set indices (data.validation), or None."""


def sample_clients(seed: int, round_index: int, num_clients: int, clients_per_round: int) -> list[int]:
    """The round's clients: the same draw on every rank and for any number of ranks."""
    generator = seeded_generator(seed, SAMPLING_STREAM, round_index)
    return sorted(torch.randperm(num_clients, generator=generator)[:clients_per_round].tolist())


def aggregation_weights(clients: list[int], sizes: list[int], weighting: str) -> dict[int, float]:
    if weighting == "uniform":
        return {c: 1.0 / len(clients) for c in clients}
    total = sum(sizes[c] for c in clients)
    return {c: sizes[c] / total for c in clients}


def clients_of_rank(clients: list[int], rank: int, world_size: int, stateful: bool) -> list[int]:
    """Stateful clients stay with their owner rank (client id mod world size), where their state
    lives; stateless clients are dealt round-robin so ranks get nearly equal shares."""
    if stateful:
        return [c for c in clients if c % world_size == rank]
    return clients[rank::world_size]


STOP_REQUESTED = "stop_requested"
REQUEUE_REQUESTED = "requeue_requested"


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
    """The flat buffer one all-reduce sums: weighted uploads, float buffers, summed uploads, the
    weighted training loss, the ranks' stop votes (`stop_vote`) and the number of ranks asked to
    requeue (a preemption signal), in that order. Riding on the aggregation, a stop request needs no
    collective of its own."""

    def __init__(self, algorithm: Algorithm, num_params: int, num_buffers: int, device: torch.device):
        self.sections: list[tuple[str, int, bool]] = (
            [(name, num_params, True) for name in algorithm.weighted_uploads]
            + [("buffers", num_buffers, True)]
            + [(name, num_params, False) for name in algorithm.summed_uploads]
            + [("train_loss", 1, True), (STOP_REQUESTED, 1, False), (REQUEUE_REQUESTED, 1, False)]
        )
        self.flat = torch.zeros(sum(size for _, size, _ in self.sections), device=device)
        self._views = dict(zip([n for n, _, _ in self.sections], self.flat.split([s for _, s, _ in self.sections])))
        self._weighted = {n for n, _, w in self.sections if w}

    def add(self, values: dict[str, torch.Tensor], weight: float) -> None:
        for name, value in values.items():
            self._views[name].add_(value, alpha=weight if name in self._weighted else 1.0)

    def reduced(self, fabric) -> dict[str, torch.Tensor]:
        total = fabric.all_reduce(self.flat, reduce_op="sum") if fabric.world_size > 1 else self.flat
        return dict(zip([n for n, _, _ in self.sections], total.split([s for _, s, _ in self.sections])))


class ClientStates:
    """Per-client vectors of stateful algorithms (SCAFFOLD's c_i, FedDyn's h_i, MOON's previous
    model), kept off the accelerator by the client's owner rank. A client has an entry only once
    it has trained, so memory is one float32 vector per name per client that took part."""

    def __init__(self, initial: Optional[dict] = None):
        self.by_client: dict[int, dict[str, torch.Tensor]] = {}
        self._pin = torch.cuda.is_available()
        for client_id, state in (initial or {}).items():
            self.put(client_id, state)

    def get(self, client_id: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {k: v.to(device, non_blocking=True) for k, v in self.by_client.get(client_id, {}).items()}

    def put(self, client_id: int, state: dict[str, torch.Tensor]) -> None:
        stored = {}
        for name, value in state.items():
            host = value.detach().to("cpu", copy=True)
            stored[name] = host.pin_memory() if self._pin else host
        self.by_client[client_id] = stored


@dataclass
class ValidationShare:
    """One rank's share of the clients' held-out samples: the clients dealt to it round-robin and
    their samples, laid out so that per-client sums need neither a Python loop nor atomic adds (whose
    order, on a GPU, would change the last bits from one run to the next)."""

    clients: torch.Tensor
    """The rank's clients, in order."""
    samples: torch.Tensor
    """Their training-set indices, client after client."""
    row: torch.Tensor
    column: torch.Tensor
    """Each sample's place in a [clients, largest client] table: its client's row, its place there."""
    largest: int

    @classmethod
    def of(cls, validation: list[np.ndarray], rank: int, world_size: int, device: torch.device) -> "ValidationShare":
        clients = np.arange(rank, len(validation), world_size)
        sizes = np.array([len(validation[c]) for c in clients], dtype=np.int64)
        samples = np.concatenate([np.empty(0, dtype=np.int64), *(validation[c] for c in clients)])
        row = np.repeat(np.arange(len(clients)), sizes)
        column = np.arange(len(samples)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        clients, samples, row, column = (torch.as_tensor(a, dtype=torch.long, device=device)
                                         for a in (clients, samples, row, column))
        return cls(clients, samples, row, column, largest=int(sizes.max(initial=0)))

    def sum_by_client(self, values: torch.Tensor) -> torch.Tensor:
        """[k, samples] -> [k, clients]: each client's sum over its samples, in their order."""
        table = values.new_zeros(len(values), len(self.clients), self.largest)
        table[:, self.row, self.column] = values
        return table.sum(dim=2)


@dataclass
class FlatGlobalModel:
    """The global model as two flat vectors that the module's own tensors are views of, so the
    server's in-place steps are the model (for evaluation and checkpoints alike)."""

    param_layout: FlatLayout
    buffer_layout: FlatLayout
    params: torch.Tensor
    buffers: torch.Tensor
    """The float buffers (BatchNorm running statistics)."""

    @classmethod
    def bind(cls, module: torch.nn.Module, device: torch.device) -> "FlatGlobalModel":
        param_layout = FlatLayout.of(module.named_parameters())
        buffer_layout = FlatLayout.of((n, b) for n, b in module.named_buffers() if b.is_floating_point())
        params = param_layout.flatten(dict(module.named_parameters())).to(device)
        buffers = buffer_layout.flatten(dict(module.named_buffers())).to(device)
        for name, view in param_layout.views(params).items():
            module.get_parameter(name).data = view
        for name, view in buffer_layout.views(buffers).items():
            module.get_buffer(name).data = view
        return cls(param_layout, buffer_layout, params, buffers)


class FederatedLoop:
    """One rank's federation: the global model, the algorithm's state, the clients this rank owns,
    and the rounds run so far (`history`, one metrics row per round). Callbacks get it as `loop`."""

    def __init__(self, fabric, run: FederatedRun):
        self.fabric, self.run = fabric, run
        self.rounds, self.out_dir, self.hyperparameters = run.federation.rounds, run.out_dir, run.hyperparameters
        device = fabric.device
        self.module = fabric.to_device(run.module)
        self.global_model = FlatGlobalModel.bind(self.module, device)
        self.algorithm = run.algorithm
        self.algorithm.setup(run.server_optimizer, self.global_model.param_layout.numel, run.federation.num_clients,
                             device)
        state = run.resume_state
        self.start_round = 0 if state is None else state["round"]
        self.history: list[dict] = [] if state is None else list(state["metrics"])
        if state is not None:
            self.module.load_state_dict(state["model"])
            self.algorithm.load_state_dict(state["algorithm"], device)
        self.stateful = bool(self.algorithm.client_state)
        saved_states = {} if state is None else state["client_states"]
        self.client_states = ClientStates({c: s for c, s in saved_states.items()
                                           if c % fabric.world_size == fabric.global_rank})
        self.trainer = self._local_trainer(device)
        self.client_path = ClientPath.of(run.compute, self.algorithm, device, run.federation.batch_size)
        if self.client_path.grouped:
            normalise_batches_in_float32(self.module)
        self.test_images, self.test_labels = run.test.images.to(device), run.test.labels.to(device)
        self.test_transform = DeviceTransform(run.test.mean, run.test.std, augment=False)
        self.validation = None if run.validation is None else ValidationShare.of(
            run.validation, fabric.global_rank, fabric.world_size, device)
        self.validation_transform = DeviceTransform(run.train.mean, run.train.std, augment=False)
        self.sizes = [len(p) for p in run.partition]
        self.weighting = run.federation.weighting or self.algorithm.default_weighting
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
        run, global_model = self.run, self.global_model
        data = TrainingData(run.train.images.to(device), run.train.labels.to(device),
                            DeviceTransform(run.train.mean, run.train.std, augment=run.data.augment,
                                            crop_padding=run.data.crop_padding))
        settings = LocalSettings(run.seed, run.federation, run.client_optimizer, run.constraint, run.compute)
        return LocalTrainer(self.fabric, self.module, data, global_model, run.partition, settings)

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
        return [callback for callback in self.fabric._callbacks if isinstance(callback, Callback)]

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
        fabric, federation, algorithm = self.fabric, self.run.federation, self.algorithm
        clients = sample_clients(self.run.seed, round_index, federation.num_clients, federation.clients_per_round)
        weights = aggregation_weights(clients, self.sizes, self.weighting)
        buffer = UploadBuffer(algorithm, self.global_model.param_layout.numel, self.global_model.buffer_layout.numel,
                              fabric.device)
        hooks_seconds = 0.0  # diagnostics' time on their rounds, left out of the round's own time
        runs = self._client_runs(clients, round_index)
        for client, contribution, uploads in client_updates(algorithm, runs, self.client_path, weights):
            if self.stateful:
                self.client_states.put(client.client_id, client.state)
            hook_started = time.perf_counter()
            # A fused client's own uploads are computed here, if a callback reads them: its cost.
            fabric.call("on_client_end", fabric, self, client, uploads, weights[client.client_id])
            hooks_seconds += time.perf_counter() - hook_started
            buffer.add({**contribution, "buffers": client.buffers, "train_loss": client.mean_loss.reshape(1)},
                       weights[client.client_id])
        asked, self._asked_since_aggregation = self._asked_since_aggregation, {}
        vote = stop_vote(list(asked.values()), fabric.world_size)
        one = torch.ones(1, device=fabric.device)
        buffer.add({**({STOP_REQUESTED: vote * one} if vote else {}),
                    **({REQUEUE_REQUESTED: one} if self._requeue_requested else {})}, 1.0)
        aggregate = buffer.reduced(fabric)
        self._check_finite(round_index, clients, "the aggregated update of clients",
                           [aggregate[name] for name in algorithm.weighted_uploads + algorithm.summed_uploads])
        algorithm.server_update(self.global_model.params, aggregate)
        self.global_model.buffers.copy_(aggregate["buffers"])
        # Checked before anything is saved: a non-finite model must never become "the last good checkpoint".
        self._check_finite(round_index, clients, "the global model after the server step of clients",
                           [self.global_model.params, self.global_model.buffers])
        votes = aggregate[STOP_REQUESTED].item()
        self.stopping = votes > 0
        if is_final_vote(votes, fabric.world_size):
            self.final_stop = "; ".join(sorted(r for r, final in asked.items() if final)) or "requested by another rank"
        # A run stopped for good is not requeued: the requeued job would have nothing to train.
        self.requeue_agreed = aggregate[REQUEUE_REQUESTED].item() > 0 and self.final_stop is None
        metrics = {"round": round_index + 1, "train_loss": aggregate["train_loss"].item(),
                   **algorithm.round_metrics(), "round_seconds": time.perf_counter() - started - hooks_seconds}
        self.history.append(metrics)
        return metrics

    def _client_runs(self, clients: list[int], round_index: int):
        """This rank's clients of the round, each set up only when the algorithm asks for it."""
        fabric = self.fabric
        for client_id in clients_of_rank(clients, fabric.global_rank, fabric.world_size, self.stateful):
            yield self.trainer.client_run(client_id, round_index, self.client_states.get(client_id, fabric.device))

    def _check_finite(self, round_index: int, clients: list[int], what: str, tensors: list[torch.Tensor]) -> None:
        if all(torch.isfinite(t).all() for t in tensors):
            return
        saved = last_good_checkpoint(self.out_dir)
        last_good = "no checkpoint was saved yet" if saved is None else f"the last good checkpoint is {saved}"
        raise FloatingPointError(f"round {round_index + 1}: {what} {clients} is not finite (NaN or inf; is a "
                                 f"learning rate too large?); {last_good}")

    def evaluate(self) -> dict[str, float]:
        """The global model's test metrics, each rank evaluating a shard of the test split; with a
        validation split, also its metrics on the clients' held-out samples (`validation_metrics`)."""
        fabric, module = self.fabric, self.module
        module.eval()
        shard = torch.arange(fabric.global_rank, len(self.test_labels), fabric.world_size, device=fabric.device)
        with torch.no_grad(), fabric.autocast():
            for chunk in shard.split(self.run.federation.eval_batch_size):
                module.validation_step((self.test_transform(self.test_images[chunk]), self.test_labels[chunk]))
        metrics = module.compute_test_metrics()
        if self.validation is not None:
            metrics.update(self.validation_metrics())
        return metrics

    def validation_metrics(self) -> dict[str, float]:
        """val_accuracy and val_loss over every client's held-out samples together, and with
        data.per_client_eval the accuracy of each client on its own, summarised over the clients:
        mean, std (over all clients, ddof = 0), min and 10th percentile (linear interpolation, as
        numpy's default). Each rank evaluates a share of the clients; one all-reduce(sum) of their
        per-client counts."""
        fabric, share, trainer, held_out = self.fabric, self.validation, self.trainer, self.run.validation
        batch_size = self.run.federation.eval_batch_size
        outcomes = torch.empty(2, len(share.samples), device=fabric.device)  # per sample: right (1 or 0), loss
        with torch.no_grad(), fabric.autocast():
            for start in range(0, len(share.samples), batch_size):
                samples = share.samples[start:start + batch_size]
                correct, losses = self.module.sample_outcomes(
                    (self.validation_transform(trainer.data.images[samples]), trainer.data.labels[samples]))
                outcomes[:, start:start + batch_size] = torch.stack([correct.float(), losses])
        counts = torch.zeros(2, len(held_out), device=fabric.device)
        counts[:, share.clients] = share.sum_by_client(outcomes)
        counts = fabric.all_reduce(counts, reduce_op="sum") if fabric.world_size > 1 else counts
        correct, loss = counts.double().cpu()
        samples = torch.tensor([len(part) for part in held_out], dtype=torch.float64)
        metrics = {VAL_ACCURACY: (correct.sum() / samples.sum()).item(), VAL_LOSS: (loss.sum() / samples.sum()).item()}
        if self.run.data.per_client_eval:
            accuracies = correct / samples
            metrics.update({
                CLIENT_VAL_ACCURACY_MEAN: accuracies.mean().item(),
                CLIENT_VAL_ACCURACY_STD: accuracies.std(correction=0).item(),
                CLIENT_VAL_ACCURACY_MIN: accuracies.min().item(),
                CLIENT_VAL_ACCURACY_P10: torch.quantile(accuracies, 0.1).item(),
            })
        return metrics

    def save_checkpoint(self) -> None:
        """The state after the last completed round (collective: every rank calls it)."""
        fabric, completed = self.fabric, self.completed_rounds
        if self.stateful:
            save_client_shard(self.client_states.by_client, self.out_dir, completed, fabric.global_rank)
            fabric.barrier()  # every shard is on disk before the main file marks the checkpoint complete
        if fabric.global_rank == 0:
            save_checkpoint({
                "round": completed,
                "model": {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()},
                "algorithm": self.algorithm.state_dict(),
                "partition": [p.tolist() for p in self.run.partition],
                **({} if self.run.validation is None else {"validation": [p.tolist() for p in self.run.validation]}),
                "run_id": self.run.run_id,
                "client_state_shards": fabric.world_size if self.stateful else 0,
                "rng": torch.get_rng_state(),
                "hyperparameters": self.hyperparameters,
                "metrics": self.history,
                FINAL_STOP: self.final_stop,
                PENDING_FINAL_STOPS: sorted(r for r, final in self._asked_since_aggregation.items() if final),
                CALLBACKS: callback_states(self.callbacks),
            }, self.out_dir, self.run.checkpoint_keep)
        fabric.barrier()


def train(fabric, run: FederatedRun) -> None:
    """Run the federation, calling the callbacks given to Fabric around every round; the final
    global model is the last checkpoint. A collective that fails because another rank is gone
    raises RankLost, naming it."""
    loop = FederatedLoop(fabric, run)
    ranks = RankProcesses.gather(fabric)  # now: a rank gone later cannot say who it was
    fabric.call("on_fit_start", fabric, loop)
    try:
        for round_index in range(loop.start_round, loop.rounds):
            fabric.call("on_round_start", fabric, loop, round_index)
            metrics = loop.run_round(round_index)
            fabric.call("on_round_end", fabric, loop, metrics)
            if loop.stopping:
                break
    except BaseException as err:
        lost = ranks.lost(err, round_index + 1)
        loop.failure = lost or err
        if lost is not None:
            raise lost from err
        raise
    finally:
        fabric.call("on_fit_end", fabric, loop)
