"""The global model's evaluation: on the test split, each rank a shard, and with a validation split
on the clients' held-out training samples, each rank a share of the clients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fl_lightning.clients.run import Batch
from fl_lightning.data import DeviceTransform, ImageDataset
from fl_lightning.federation.trainer import TrainingData
from fl_lightning.metric_names import (
    CLIENT_VAL_ACCURACY_MEAN,
    CLIENT_VAL_ACCURACY_MIN,
    CLIENT_VAL_ACCURACY_P10,
    CLIENT_VAL_ACCURACY_STD,
    VAL_ACCURACY,
    VAL_LOSS,
)


class Evaluation:
    """One rank's evaluation of the global model held by `module` (a ClassificationModule)."""

    def __init__(self, engine, module, test: ImageDataset, training: TrainingData,
                 validation: Optional[list[np.ndarray]], batch_size: int, per_client: bool):
        """`training` is the rank's copy of the training split (the held-out samples are in it),
        `validation` each client's held-out indices (None without a validation split)."""
        device = engine.device
        self.engine, self.module, self.batch_size, self.per_client = engine, module, batch_size, per_client
        self.test_images, self.test_labels = test.images.to(device), test.labels.to(device)
        self.test_transform = DeviceTransform(test.mean, test.std, augment=False)
        self.training = training
        self.held_out = validation
        self.validation = None if validation is None else ValidationShare.of(
            validation, engine.global_rank, engine.world_size, device)
        self.validation_transform = None if validation is None else DeviceTransform(
            training.transform.mean, training.transform.std, augment=False)

    @property
    def test_size(self) -> int:
        return len(self.test_labels)

    def test_batch(self, indices: torch.Tensor) -> Batch:
        """The test samples at `indices`, normalised on the device."""
        indices = indices.to(self.test_images.device)
        return self.test_transform(self.test_images[indices]), self.test_labels[indices]

    def metrics(self) -> dict[str, float]:
        """The global model's test metrics, each rank evaluating a shard of the test split; with a
        validation split, also its metrics on the clients' held-out samples (`validation_metrics`)."""
        engine, module = self.engine, self.module
        module.eval()
        shard = torch.arange(engine.global_rank, self.test_size, engine.world_size, device=engine.device)
        with torch.no_grad(), engine.autocast():
            for chunk in shard.split(self.batch_size):
                module.validation_step(self.test_batch(chunk))
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
        engine, share, training = self.engine, self.validation, self.training
        outcomes = torch.empty(2, len(share.samples), device=engine.device)  # per sample: right (1 or 0), loss
        with torch.no_grad(), engine.autocast():
            for start in range(0, len(share.samples), self.batch_size):
                samples = share.samples[start:start + self.batch_size]
                correct, losses = self.module.sample_outcomes(
                    (self.validation_transform(training.images[samples]), training.labels[samples]))
                outcomes[:, start:start + self.batch_size] = torch.stack([correct.float(), losses])
        counts = torch.zeros(2, len(self.held_out), device=engine.device)
        counts[:, share.clients] = share.sum_by_client(outcomes)
        counts = engine.all_reduce(counts, reduce_op="sum") if engine.world_size > 1 else counts
        correct, loss = counts.double().cpu()
        samples = torch.tensor([len(part) for part in self.held_out], dtype=torch.float64)
        metrics = {VAL_ACCURACY: (correct.sum() / samples.sum()).item(), VAL_LOSS: (loss.sum() / samples.sum()).item()}
        if self.per_client:
            accuracies = correct / samples
            metrics.update({
                CLIENT_VAL_ACCURACY_MEAN: accuracies.mean().item(),
                CLIENT_VAL_ACCURACY_STD: accuracies.std(correction=0).item(),
                CLIENT_VAL_ACCURACY_MIN: accuracies.min().item(),
                CLIENT_VAL_ACCURACY_P10: torch.quantile(accuracies, 0.1).item(),
            })
        return metrics


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
