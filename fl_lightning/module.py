"""The client's model logic as a LightningModule: the loss and the evaluation metrics.

Algorithms never re-implement the loss: they evaluate `training_step` at parameters of their own
choosing through `torch.func.functional_call` (see `fl_lightning.federation.trainer`).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from fl_lightning.metric_names import TEST_ACCURACY, TEST_LOSS


class ClassificationModule(L.LightningModule):
    def __init__(self, network: nn.Module, num_classes: int):
        super().__init__()
        self.network = network
        self.test_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_loss = MeanMetric()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.network(inputs)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int = 0) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(self(inputs).float(), targets)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int = 0) -> None:
        inputs, targets = batch
        logits = self(inputs).float()
        self.test_accuracy.update(logits, targets)
        self.test_loss.update(F.cross_entropy(logits, targets), weight=len(targets))

    def sample_outcomes(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample: whether the prediction (the arg-max, as the accuracy takes it) is right, and its
        cross-entropy; for metrics summed over groups of samples (the clients' held-out parts)."""
        inputs, targets = batch
        logits = self(inputs).float()
        return logits.argmax(dim=1) == targets, F.cross_entropy(logits, targets, reduction="none")

    def compute_test_metrics(self) -> dict[str, float]:
        """Accuracy and loss over every rank's shard (torchmetrics syncs across ranks), then reset."""
        results = {
            TEST_ACCURACY: self.test_accuracy.compute().item(),
            TEST_LOSS: self.test_loss.compute().item(),
        }
        self.test_accuracy.reset()
        self.test_loss.reset()
        return results


class TrainingStepCall(nn.Module):
    """`functional_call` swaps tensors into a module and calls it; this routes that call to
    `training_step`, so the loss a client differentiates is exactly the module's own."""

    prefix = "module."

    def __init__(self, module: ClassificationModule):
        super().__init__()
        self.module = module

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.module.training_step(batch, 0)
