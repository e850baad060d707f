"""Direct, slow reference computations for update-rule tests.

The problem: multinomial logistic regression (`model.name: linear`) on full client batches, so
every gradient is deterministic and the reference needs nothing of the product but its data
files, its partition file and its client-sampling draw.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fl_lightning.config import DataArgs, FabricArgs, FederationArgs, LoggerArgs, ModelArgs
from fl_lightning.data import load_dataset
from fl_lightning.models import create_model

SEED = 3


def small_setup(root: Path, out_dir: Path, **federation) -> dict:
    """fit() keyword arguments for a tiny, full-batch, partially participating federation."""
    federation_args = dict(rounds=3, num_clients=5, clients_per_round=3, local_epochs=2, batch_size=1000,
                           eval_every=3)
    federation_args.update(federation)
    return dict(
        model=ModelArgs(name="linear"),
        data=DataArgs(name="cifar10", root=root, partition="dirichlet", alpha=1.0, min_samples=10, augment=False),
        federation=FederationArgs(**federation_args),
        # A short collective timeout: a rank left waiting by a failed peer ends the test quickly.
        fabric=FabricArgs(accelerator="cpu", devices=1, process_group_timeout_s=120),
        logger=LoggerArgs(progress_bar=False),
        seed=SEED,
        out_dir=out_dir,
        resume=None,
    )


class LinearProblem:
    """Each client's full-batch loss on the exact inputs the product's model sees."""

    def __init__(self, root: Path, out_dir: Path):
        train, _ = load_dataset("cifar10", root)
        mean = torch.tensor(train.mean).view(1, -1, 1, 1)
        std = torch.tensor(train.std).view(1, -1, 1, 1)
        self.inputs = ((train.images.double() / 255 - mean) / std).flatten(1)
        self.labels = train.labels
        self.num_classes = train.num_classes
        partition = json.loads((Path(out_dir) / "partition.json").read_text())
        self.client_samples = [torch.tensor(partition[str(i)]) for i in range(len(partition))]

    def initial_params(self) -> torch.Tensor:
        torch.manual_seed(SEED)
        model = create_model("linear", num_classes=self.num_classes, in_channels=3, image_size=32)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()

    def loss_on(self, params: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over `samples` (training-set indices)."""
        features = self.inputs.shape[1]
        weight = params[: self.num_classes * features].view(self.num_classes, features)
        bias = params[self.num_classes * features:]
        return F.cross_entropy(self.inputs[samples] @ weight.T + bias, self.labels[samples])

    def grad_on(self, params: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
        params = params.detach().clone().requires_grad_(True)
        (gradient,) = torch.autograd.grad(self.loss_on(params, samples), params)
        return gradient

    def loss(self, params: torch.Tensor, client: int) -> torch.Tensor:
        """The client's full-batch loss."""
        return self.loss_on(params, self.client_samples[client])

    def grad(self, params: torch.Tensor, client: int) -> torch.Tensor:
        return self.grad_on(params, self.client_samples[client])

    def num_samples(self, client: int) -> int:
        return len(self.client_samples[client])


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=2e-5)
