"""The round loop: the one module that knows about ranks and the all-reduce.

Every rank holds the global model and server state. Each round, the sampled clients are split
over the ranks; each rank runs its clients' updates and adds their weighted uploads into one flat
buffer; one all-reduce(sum) aggregates; every rank then applies the same server rule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fl_lightning.algorithms import Algorithm
from fl_lightning.checkpoint import checkpoint_dir, numbered_checkpoints, save_checkpoint, save_client_shard
from fl_lightning.cluster import STOP_SIGNALS, requeue_after_stop
from fl_lightning.client import SAMPLING_STREAM, LocalTrainer, seeded_generator
from fl_lightning.constraints import Constraint
from fl_lightning.config import CheckpointArgs, ClientOptimizerArgs, DataArgs, FederationArgs, LoggerArgs
from fl_lightning.data import DeviceTransform, ImageDataset
from fl_lightning.flat import FlatLayout
from fl_lightning.module import ClassificationModule
from fl_lightning.run_logging import MetricsLog, WandbIdentity, WandbRun, round_line
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
    logger: LoggerArgs
    checkpoint: CheckpointArgs
    seed: int
    out_dir: Path
    wandb_identity: WandbIdentity
    hyperparameters: dict
    constraint: Optional[Constraint] = None
    resume_state: Optional[dict] = None
    wandb: Optional[WandbRun] = None
    """Rank 0's W&B run, or None when W&B is disabled."""


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


class UploadBuffer:
    """The flat buffer one all-reduce sums: weighted uploads, float buffers, summed uploads, the
    weighted training loss, and the number of ranks asked to stop (a preemption signal), in that
    order. Riding on the aggregation, the stop request needs no collective of its own."""

    def __init__(self, algorithm: Algorithm, num_params: int, num_buffers: int, device: torch.device):
        self.sections: list[tuple[str, int, bool]] = (
            [(name, num_params, True) for name in algorithm.weighted_uploads]
            + [("buffers", num_buffers, True)]
            + [(name, num_params, False) for name in algorithm.summed_uploads]
            + [("train_loss", 1, True), (STOP_REQUESTED, 1, False)]
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


def train(fabric, run: FederatedRun) -> None:
    """Run the federation; the final global model is the last checkpoint."""
    federation = run.federation
    device = fabric.device
    module = fabric.to_device(run.module)
    global_model = FlatGlobalModel.bind(module, device)
    param_layout, buffer_layout = global_model.param_layout, global_model.buffer_layout
    params, global_buffers = global_model.params, global_model.buffers

    algorithm = run.algorithm
    algorithm.setup(run.server_optimizer, param_layout.numel, federation.num_clients, device)
    start_round = 0
    history = [] if run.resume_state is None else list(run.resume_state["metrics"])
    if run.resume_state is not None:
        module.load_state_dict(run.resume_state["model"])
        algorithm.load_state_dict(run.resume_state["algorithm"], device)
        start_round = run.resume_state["round"]

    train_images, train_labels = run.train.images.to(device), run.train.labels.to(device)
    test_images, test_labels = run.test.images.to(device), run.test.labels.to(device)
    train_transform = DeviceTransform(run.train.mean, run.train.std, augment=run.data.augment,
                                      crop_padding=run.data.crop_padding)
    test_transform = DeviceTransform(run.test.mean, run.test.std, augment=False)
    trainer = LocalTrainer(fabric, module, train_images, train_labels, train_transform, param_layout, buffer_layout,
                           run.constraint)
    saved_states = {} if run.resume_state is None else run.resume_state["client_states"]
    client_states = ClientStates({c: state for c, state in saved_states.items()
                                  if c % fabric.world_size == fabric.global_rank})
    client_indices = [torch.as_tensor(p, dtype=torch.long) for p in run.partition]
    sizes = [len(p) for p in run.partition]
    weighting = federation.weighting or algorithm.default_weighting
    stateful = bool(algorithm.client_state)

    def evaluate() -> dict[str, float]:
        module.eval()
        shard = torch.arange(fabric.global_rank, len(test_labels), fabric.world_size, device=device)
        with torch.no_grad(), fabric.autocast():
            for chunk in shard.split(federation.eval_batch_size):
                module.validation_step((test_transform(test_images[chunk]), test_labels[chunk]))
        return module.compute_test_metrics()

    is_logger = fabric.global_rank == 0
    wandb = run.wandb if is_logger else None
    if wandb is not None:
        wandb.start(run.hyperparameters)
        wandb.replay(history)
    metrics_log = MetricsLog(run.out_dir, history) if is_logger else None
    progress = _progress_bar(run, start_round) if is_logger else None
    latest_accuracy = None
    installed_here = STOP_SIGNALS.install(run.checkpoint.requeue_signal)
    stopped_early = False
    try:
        for round_index in range(start_round, federation.rounds):
            started = time.perf_counter()
            clients = sample_clients(run.seed, round_index, federation.num_clients, federation.clients_per_round)
            weights = aggregation_weights(clients, sizes, weighting)
            buffer = UploadBuffer(algorithm, param_layout.numel, buffer_layout.numel, device)
            runs = (
                trainer.client_run(
                    client_id=client_id, round_index=round_index, seed=run.seed,
                    sample_indices=client_indices[client_id], global_params=params, global_buffers=global_buffers,
                    state=client_states.get(client_id, device), batch_size=federation.batch_size,
                    local_steps=federation.local_steps, local_epochs=federation.local_epochs,
                    optimizer_args=run.client_optimizer,
                )
                for client_id in clients_of_rank(clients, fabric.global_rank, fabric.world_size, stateful)
            )
            for client, uploads in algorithm.client_updates(runs):
                client_id = client.client_id
                if stateful:
                    client_states.put(client_id, client.state)
                uploads["buffers"] = client.buffers
                uploads["train_loss"] = torch.tensor([client.mean_loss], device=device)
                buffer.add(uploads, weights[client_id])
            buffer.add({STOP_REQUESTED: torch.ones(1, device=device)} if STOP_SIGNALS.requested else {}, 1.0)
            aggregate = buffer.reduced(fabric)
            _check_finite(run, round_index, clients, "the aggregated update of clients",
                          [aggregate[name] for name in algorithm.weighted_uploads + algorithm.summed_uploads])
            algorithm.server_update(params, aggregate)
            global_buffers.copy_(aggregate["buffers"])
            # Checked before anything is saved: a non-finite model must never become "the last good checkpoint".
            _check_finite(run, round_index, clients, "the global model after the server step of clients",
                          [params, global_buffers])

            completed = round_index + 1
            metrics = {"round": completed, "train_loss": aggregate["train_loss"].item()}
            metrics.update(algorithm.round_metrics())
            if completed % federation.eval_every == 0 or completed == federation.rounds:
                metrics.update(evaluate())
                latest_accuracy = metrics["test_accuracy"]
            metrics["round_seconds"] = time.perf_counter() - started
            history.append(metrics)
            stopped_early = aggregate[STOP_REQUESTED].item() > 0 and completed < federation.rounds
            if stopped_early or completed % run.checkpoint.every == 0 or completed == federation.rounds:
                _save(fabric, run, module, algorithm, client_states if stateful else None, completed, history)
            if is_logger:
                metrics_log.append(metrics)
                if wandb is not None:
                    wandb.log(metrics)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(s_per_round=f"{metrics['round_seconds']:.2f}",
                                         acc="-" if latest_accuracy is None else f"{latest_accuracy:.4f}")
                else:
                    print(round_line(metrics, federation.rounds), flush=True)
            if stopped_early:
                break
        if progress is not None:
            progress.close()
        if wandb is not None:
            wandb.finish()  # before a requeue: Slurm kills the job's steps as soon as it is requeued
        if is_logger:
            _print_summary(run, history, stopped_early)
            if stopped_early:
                requeue_after_stop(run.checkpoint.requeue_signal, STOP_SIGNALS.received)
    finally:
        if wandb is not None:
            wandb.finish()  # also when a round failed: what was logged must reach the W&B files
        STOP_SIGNALS.uninstall(installed_here)


def _check_finite(run: FederatedRun, round_index: int, clients: list[int], what: str,
                  tensors: list[torch.Tensor]) -> None:
    if all(torch.isfinite(t).all() for t in tensors):
        return
    saved = numbered_checkpoints(checkpoint_dir(run.out_dir))
    last_good = f"the last good checkpoint is {saved[-1]}" if saved else "no checkpoint was saved yet"
    raise FloatingPointError(
        f"round {round_index + 1}: {what} {clients} is not finite (NaN or inf; is a learning rate too "
        f"large?); {last_good}"
    )


def _print_summary(run: FederatedRun, history: list[dict], stopped_early: bool) -> None:
    final = history[-1] if history else {"round": run.federation.rounds}
    accuracies = [row["test_accuracy"] for row in history if row.get("test_accuracy") is not None]
    state = "stopped (checkpoint saved)" if stopped_early else "finished"
    accuracy = f"; final test_accuracy {accuracies[-1]:.4f}, best {max(accuracies):.4f}" if accuracies else ""
    print(f"{state} at round {final['round']}/{run.federation.rounds}{accuracy}; outputs in {run.out_dir}",
          flush=True)


def _save(fabric, run: FederatedRun, module, algorithm: Algorithm, client_states: Optional[ClientStates],
          completed: int, history: list[dict]) -> None:
    if client_states is not None:
        save_client_shard(client_states.by_client, run.out_dir, completed, fabric.global_rank)
        fabric.barrier()  # every shard is on disk before the main file marks the checkpoint complete
    if fabric.global_rank == 0:
        save_checkpoint({
            "round": completed,
            "model": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
            "algorithm": algorithm.state_dict(),
            "partition": [p.tolist() for p in run.partition],
            "run_id": run.wandb_identity.run_id,
            "client_state_shards": fabric.world_size if client_states is not None else 0,
            "rng": torch.get_rng_state(),
            "hyperparameters": run.hyperparameters,
            "metrics": history,
        }, run.out_dir, run.checkpoint.keep)
    fabric.barrier()


def _progress_bar(run: FederatedRun, start_round: int):
    if not run.logger.progress_bar:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=run.federation.rounds, initial=start_round, desc="rounds", unit="round", dynamic_ncols=True)
