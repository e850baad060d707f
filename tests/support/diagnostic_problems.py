"""Small problems the diagnostics are checked on: a quadratic whose curvature is known, a tiny network, a
federated loop that runs them a few rounds, the callbacks config that switches a diagnostic on, and one
round of known uploads and gradient samples with what the local-update diagnostics must report on it
(`by_hand`, computed directly from their definitions)."""

import itertools
from pathlib import Path

import numpy as np
import torch
import yaml
from lightning.fabric import Fabric
from paths import QUICKSTART
from torch import nn

from fl_lightning.checkpoint import checkpoint_dir
from fl_lightning.config import ClientOptimizerArgs, ComputeArgs, DataArgs, FederationArgs
from fl_lightning.data import ImageDataset
from fl_lightning.federation.loop import FederatedLoop
from fl_lightning.federation.setup import RunData, RunSettings, rank_inputs
from fl_lightning.module import ClassificationModule
from fl_lightning.server_optimizers import ServerSGD

TINY = ["--config", QUICKSTART, "--model.options", "{hidden: 16, depth: 1}", "--federation.local_steps", "2",
        "--federation.eval_every", "2", "--logger.progress_bar", "false", "--resume", "null"]


def symmetric_matrix(eigenvalues: list[float], seed: int = 0) -> torch.Tensor:
    """Q diag(eigenvalues) Q^T for a random orthogonal Q (float64)."""
    generator = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(eigenvalues), len(eigenvalues), generator=generator, dtype=torch.float64))
    return q @ torch.diag(torch.tensor(eigenvalues, dtype=torch.float64)) @ q.T


class Center(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.x = nn.Parameter(torch.zeros(dim))


class QuadraticModule(ClassificationModule):
    """Loss 1/2 (x - c)^T A (x - c) averaged over a batch of centres c (each sample's pixels): a
    quadratic in the parameters x with Hessian A on every batch."""

    def __init__(self, network: Center, num_classes: int, hessian: torch.Tensor):
        super().__init__(network, num_classes)
        self.hessian = hessian.float()  # a plain attribute: neither a parameter nor a buffer

    def training_step(self, batch, batch_idx: int = 0) -> torch.Tensor:
        centres, _ = batch
        offset = self.network.x - centres.flatten(1)
        return 0.5 * ((offset @ self.hessian) * offset).sum(1).mean()


def federated_loop(network: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                   partition: list[np.ndarray], algorithm, callbacks: list, *, local_steps: int = 2,
                   batch_size: int = 4, server_lr: float = 0.5, clients_per_round: int = None, augment: bool = False,
                   seed: int = 0, num_classes: int = 2, rounds: int = 10**6, test: tuple = None,
                   client_path: str = "loop", module_type=None) -> tuple[Fabric, FederatedLoop]:
    """A loop set up as `federation.train` sets one up on a single rank; the test split is the
    training data unless `test` gives (images, labels)."""
    channels = images.shape[1]
    dataset = ImageDataset(images, labels, num_classes, (0.5,) * channels, (0.25,) * channels)
    test_set = dataset if test is None else ImageDataset(*test, num_classes, (0.5,) * channels, (0.25,) * channels)
    settings = RunSettings(
        algorithm=algorithm, server_optimizer=ServerSGD(lr=server_lr),
        federation=FederationArgs(rounds=rounds, num_clients=len(partition),
                                  clients_per_round=clients_per_round or len(partition), local_steps=local_steps,
                                  batch_size=batch_size),
        data=DataArgs(augment=augment, crop_padding=1), client_optimizer=ClientOptimizerArgs(lr=0.1),
        seed=seed, compute=ComputeArgs(client_path=client_path),
    )
    run = rank_inputs(settings, out_dir=Path("unused"), run_id="test", hyperparameters={},
                    data=RunData(dataset, test_set, partition), network=network, module_type=module_type)
    engine = Fabric(accelerator="cpu", devices=1, callbacks=callbacks)
    return engine, FederatedLoop(engine, run)


def run_rounds(engine: Fabric, loop: FederatedLoop, rounds: int) -> list[dict]:
    engine.call("on_fit_start", engine, loop)
    rows = []
    for round_index in range(rounds):
        engine.call("on_round_start", engine, loop, round_index)
        metrics = loop.run_round(round_index)
        engine.call("on_round_end", engine, loop, metrics)
        rows.append(metrics)
    return rows


class TinyNet(nn.Module):
    """conv - BatchNorm - ReLU - linear on 1 x 4 x 4 images: 51 parameters."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.norm = nn.BatchNorm2d(2)
        self.classifier = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.norm(self.conv(x))).flatten(1))


def tiny_network_problem(samples: int = 48):
    torch.manual_seed(0)
    network = TinyNet()
    # Running statistics far from a batch's own: a loss in training mode would differ clearly.
    network.norm.running_mean.copy_(torch.tensor([0.3, -0.2]))
    network.norm.running_var.copy_(torch.tensor([2.0, 0.5]))
    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (samples, 1, 4, 4), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 3, (samples,), generator=generator)
    partition = [np.arange(i, samples, 4) for i in range(4)]
    test = (torch.randint(0, 256, (30, 1, 4, 4), dtype=torch.uint8, generator=generator),
            torch.randint(0, 3, (30,), generator=generator))
    return network, images, labels, partition, test


def callbacks_config(tmp_path: Path, *callbacks: dict) -> str:
    path = tmp_path / "diagnostics.yaml"
    path.write_text(yaml.safe_dump({"callbacks": list(callbacks)}))
    return str(path)


def final_checkpoint(out_dir: Path) -> dict:
    return torch.load(checkpoint_dir(out_dir) / "last.ckpt", weights_only=False)


# One round of known uploads and gradient samples, and what the local-update diagnostics must report on it.

NUM_CLIENTS, NUM_PARAMS, SAMPLES = 6, 5, [4, 3, 5, 4, 2, 6]


def known_round(seed: int):
    """Per client: its upload (x - y_m), aggregation weight, gradient samples; and the global model."""
    generator = torch.Generator().manual_seed(seed)
    uploads = torch.randn(NUM_CLIENTS, NUM_PARAMS, generator=generator, dtype=torch.float64).float()
    sizes = torch.tensor(SAMPLES, dtype=torch.float64)
    weights = (sizes / sizes.sum()).tolist()
    data = [torch.randn(n, NUM_PARAMS, generator=generator, dtype=torch.float64).float() for n in SAMPLES]
    params = torch.randn(NUM_PARAMS, generator=generator)
    return uploads, weights, data, params


def by_hand(seed: int = 0) -> dict[str, float]:
    uploads, weights, data, params = known_round(seed)
    u, p = uploads.double(), torch.tensor(weights, dtype=torch.float64)
    norms = torch.stack([row.norm() for row in u])
    mean_update = sum(p[m] * u[m] for m in range(NUM_CLIENTS))
    cosines = [u[i].dot(u[j]) / (u[i].norm() * u[j].norm()) for i, j in itertools.combinations(range(NUM_CLIENTS), 2)]
    expected = {
        "client_drift/mean": float(sum(p[m] * norms[m] for m in range(NUM_CLIENTS))),
        "client_drift/max": float(norms.max()),
        "drift_diversity": float(sum(p[m] * u[m].dot(u[m]) for m in range(NUM_CLIENTS)) / mean_update.dot(mean_update)),
        "client_consistency": float(sum(p[m] * u[m].dot(u[m]) for m in range(NUM_CLIENTS))),
        "update_cosine": float(sum(cosines) / len(cosines)),
    }
    # Gradients at x: every sample of every client (batch size 1, more batches asked than samples).
    g = [d.double() for d in data]
    client_means = [gm.mean(dim=0) for gm in g]
    client_vars = [gm.var(dim=0, unbiased=True) for gm in g]  # per parameter
    expected["gradient_variance"] = float(sum(p[m] * client_vars[m].sum() for m in range(NUM_CLIENTS)))
    overall = sum(p[m] * client_means[m] for m in range(NUM_CLIENTS))
    expected["gradient_variance/between_clients"] = float(
        sum(p[m] * (client_means[m] - overall).pow(2).sum() for m in range(NUM_CLIENTS)))
    client_gsnr = [client_means[m] ** 2 / client_vars[m] for m in range(NUM_CLIENTS)]
    expected["gsnr/client_sum"] = float(sum(p[m] * client_gsnr[m].sum() for m in range(NUM_CLIENTS)))
    expected["gsnr/client_mean"] = float(sum(p[m] * client_gsnr[m].mean() for m in range(NUM_CLIENTS)))
    pooled_var = sum(p[m] * (client_vars[m] + client_means[m] ** 2) for m in range(NUM_CLIENTS)) - overall ** 2
    pooled = overall ** 2 / pooled_var
    expected["gsnr/mean"] = float(pooled.mean())
    expected["gsnr/layer.weight"], expected["gsnr/layer.bias"] = float(pooled[:4].mean()), float(pooled[4])
    update_size = sum(p[m] * u[m].abs() for m in range(NUM_CLIENTS))
    order = update_size.argsort(descending=True)
    top, bottom = order[:2], order[-2:]  # update_fraction 0.4 of 5 parameters
    expected["gsnr/top_update"] = float(pooled[top].mean())
    expected["gsnr/bottom_update"] = float(pooled[bottom].mean())
    expected["weight_abs/top_update"] = float(params[top].double().abs().mean())
    expected["weight_abs/bottom_update"] = float(params[bottom].double().abs().mean())
    return expected
