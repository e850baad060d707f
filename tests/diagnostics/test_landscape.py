"""The landscape diagnostic: Lanczos, power iteration and Hutchinson against exact spectra; the
diagnostic on a quadratic and on a tiny BatchNorm network against torch.autograd.functional.hessian
of the same loss; and in a real run, its metrics on its rounds only, one reduction each, and a
final model bitwise equal to the run without it."""

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from lightning.fabric import Fabric
from paths import QUICKSTART
from torch import nn

from fl_lightning.algorithms import CTPFL, FedAvg
from fl_lightning.checkpoint import checkpoint_dir
from fl_lightning.clients.run import seeded_generator
from fl_lightning.commands.main import main
from fl_lightning.config import ClientOptimizerArgs, ComputeArgs, DataArgs, FederationArgs
from fl_lightning.data import ImageDataset
from fl_lightning.diagnostics.landscape import (
    PROBE_STREAM,
    Landscape,
    hutchinson_trace,
    lanczos_extremes,
    power_extremes,
)
from fl_lightning.errors import ConfigError
from fl_lightning.federation.loop import FederatedLoop
from fl_lightning.federation.setup import RunData, RunSettings, rank_inputs
from fl_lightning.module import ClassificationModule
from fl_lightning.run_logging import read_metrics
from fl_lightning.server_optimizers import ServerSGD

TINY = ["--config", QUICKSTART, "--model.options", "{hidden: 16, depth: 1}", "--federation.local_steps", "2",
        "--federation.eval_every", "2", "--logger.progress_bar", "false", "--resume", "null"]


def symmetric_matrix(eigenvalues: list[float], seed: int = 0) -> torch.Tensor:
    """Q diag(eigenvalues) Q^T for a random orthogonal Q (float64)."""
    generator = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(eigenvalues), len(eigenvalues), generator=generator, dtype=torch.float64))
    return q @ torch.diag(torch.tensor(eigenvalues, dtype=torch.float64)) @ q.T


# Small problems driven through the real FederatedLoop (as federation.train drives it).

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
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=callbacks)
    return fabric, FederatedLoop(fabric, run)


def run_rounds(fabric: Fabric, loop: FederatedLoop, rounds: int) -> list[dict]:
    fabric.call("on_fit_start", fabric, loop)
    rows = []
    for round_index in range(rounds):
        fabric.call("on_round_start", fabric, loop, round_index)
        metrics = loop.run_round(round_index)
        fabric.call("on_round_end", fabric, loop, metrics)
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


def exact_hessian(loop: FederatedLoop, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The Hessian of the eval-mode cross-entropy of the loop's model at its global parameters,
    from torch.autograd.functional.hessian over a functional call of the bare network."""
    network = loop.module.network
    layout, buffers = loop.global_model.param_layout, loop.global_model.buffer_layout.views(
        loop.global_model.buffers.clone())
    network.eval()

    def loss(flat: torch.Tensor) -> torch.Tensor:
        tensors = {name.removeprefix("network."): view for name, view in layout.views(flat).items()}
        tensors.update({name.removeprefix("network."): view for name, view in buffers.items()})
        logits = torch.func.functional_call(network, tensors, (inputs,))
        return nn.functional.cross_entropy(logits, labels)

    return torch.autograd.functional.hessian(loss, loop.global_model.params.detach().clone())


# The algorithms on exact spectra.

@pytest.mark.parametrize("eigenvalues", [[-3.0, -1.0, 0.5, 2.0, 7.0, 7.5], [4.0, 1.0, 0.1, 0.01]])
def test_lanczos_gives_the_extreme_eigenvalues_of_a_quadratic(eigenvalues):
    matrix = symmetric_matrix(eigenvalues).float()
    largest, smallest = lanczos_extremes(lambda v: matrix @ v, len(eigenvalues), 50, torch.Generator().manual_seed(0),
                                         torch.device("cpu"))
    assert largest == pytest.approx(max(eigenvalues), rel=1e-4, abs=1e-4)
    assert smallest == pytest.approx(min(eigenvalues), rel=1e-4, abs=1e-4)


def test_lanczos_with_fewer_steps_than_dimensions_finds_well_separated_extremes():
    eigenvalues = [-5.0] + list(np.linspace(0.0, 1.0, 198)) + [10.0]
    matrix = symmetric_matrix(eigenvalues, seed=1).float()
    largest, smallest = lanczos_extremes(lambda v: matrix @ v, 200, 30, torch.Generator().manual_seed(0),
                                         torch.device("cpu"))
    assert largest == pytest.approx(10.0, rel=1e-4)
    assert smallest == pytest.approx(-5.0, rel=1e-4)


@pytest.mark.parametrize("eigenvalues", [[-3.0, -1.0, 0.5, 2.0, 9.0], [-9.0, 0.5, 2.0, 3.0]])
def test_power_iteration_finds_both_ends_whichever_dominates(eigenvalues):
    matrix = symmetric_matrix(eigenvalues).float()
    largest, smallest = power_extremes(lambda v: matrix @ v, len(eigenvalues), 300, torch.Generator().manual_seed(0),
                                       torch.device("cpu"))
    assert largest == pytest.approx(max(eigenvalues), rel=1e-3)
    assert smallest == pytest.approx(min(eigenvalues), rel=1e-3)


def test_hutchinson_is_the_mean_of_its_probes_and_converges_to_the_trace():
    matrix = symmetric_matrix([-3.0, -1.0, 0.5, 2.0, 7.0, 1.5]).float()
    trace, stderr = hutchinson_trace(lambda v: matrix @ v, 6, 8, torch.Generator().manual_seed(3), torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    probes = [(torch.randint(0, 2, (6,), generator=generator) * 2 - 1).float() for _ in range(8)]
    direct = torch.tensor([z @ matrix @ z for z in probes], dtype=torch.float64)
    assert trace == pytest.approx(direct.mean().item(), rel=1e-6)
    assert stderr == pytest.approx(direct.std().item() / 8 ** 0.5, rel=1e-6)
    many, many_stderr = hutchinson_trace(lambda v: matrix @ v, 6, 20000, torch.Generator().manual_seed(4),
                                         torch.device("cpu"))
    assert abs(many - matrix.trace().item()) < 5 * many_stderr
    # A diagonal matrix has z^T D z = tr(D) for every Rademacher z.
    diagonal = torch.diag(torch.tensor([-2.0, 0.5, 4.0]))
    assert hutchinson_trace(lambda v: diagonal @ v, 3, 3, torch.Generator().manual_seed(0),
                            torch.device("cpu")) == (pytest.approx(2.5), 0.0)


# The diagnostic on a loop.

def test_landscape_of_a_quadratic_is_its_matrix():
    eigenvalues = [-2.0, -0.5, 0.25, 1.0, 3.0, 6.0]
    matrix = symmetric_matrix(eigenvalues)
    images = torch.randint(0, 256, (40, 1, 1, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    partition = [np.arange(0, 20), np.arange(20, 40)]
    landscape = Landscape(subset_size=16, batch_size=5, iterations=6, probes=4, seed=7)
    fabric, loop = federated_loop(Center(len(matrix)), images, torch.zeros(40, dtype=torch.long), partition,
                                  CTPFL(span=0.5), [landscape], module_type=partial(QuadraticModule, hessian=matrix))
    run_rounds(fabric, loop, 2)
    values = landscape.measure(loop)
    assert values["hessian/lambda_max"] == pytest.approx(6.0, rel=1e-4)
    assert values["hessian/lambda_min"] == pytest.approx(-2.0, rel=1e-4)
    assert values["hessian/convexity"] == pytest.approx(3.0, rel=1e-4)
    generator = seeded_generator(7, PROBE_STREAM)
    probes = [(torch.randint(0, 2, (6,), generator=generator) * 2 - 1).double() for _ in range(4)]
    assert values["hessian/trace"] == pytest.approx(np.mean([(z @ matrix @ z).item() for z in probes]), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("split, hvp, method, iterations", [
    ("train", "jvp", "lanczos", 60), ("test", "jvp", "lanczos", 60), ("test", "double_backward", "lanczos", 60),
    ("train", "double_backward", "power", 100)])
def test_landscape_of_a_tiny_batchnorm_network_matches_autograd_hessian(split, hvp, method, iterations):
    network, images, labels, partition, test = tiny_network_problem()
    landscape = Landscape(split=split, subset_size=20, batch_size=12, iterations=iterations, probes=5, hvp=hvp,
                          method=method, seed=3)
    fabric, loop = federated_loop(network, images, labels, partition, FedAvg(), [landscape], num_classes=3, test=test)
    inputs, subset_labels = landscape.subset(loop)
    assert len(subset_labels) == 20
    pool = loop.evaluation.test_transform(test[0] if split == "test" else images)
    assert (inputs[:, None] == pool[None]).flatten(2).all(2).any(1).all()  # drawn from the split asked for
    hessian = exact_hessian(loop, inputs, subset_labels)
    spectrum = torch.linalg.eigvalsh(hessian.double())
    assert spectrum[0] < 0 < spectrum[-1]  # an indefinite Hessian: both ends are tested
    values = landscape.measure(loop)
    tolerance = 1e-3 * spectrum.abs().max().item()
    assert values["hessian/lambda_max"] == pytest.approx(spectrum[-1].item(), abs=tolerance)
    assert values["hessian/lambda_min"] == pytest.approx(spectrum[0].item(), abs=tolerance)
    generator = seeded_generator(3, PROBE_STREAM)
    probes = [(torch.randint(0, 2, (hessian.shape[0],), generator=generator) * 2 - 1).float() for _ in range(5)]
    hutchinson = np.mean([(z @ hessian @ z).item() for z in probes])
    assert values["hessian/trace"] == pytest.approx(hutchinson, rel=1e-4, abs=1e-4)
    assert abs(values["hessian/trace"] - hessian.trace().item()) < 5 * values["hessian/trace_stderr"]
    expected_loss = nn.functional.cross_entropy(loop.module.network.eval()(inputs), subset_labels).item()
    assert values["hessian/loss"] == pytest.approx(expected_loss, rel=1e-5)


def test_landscape_leaves_the_model_its_buffers_and_the_global_random_stream_alone():
    network, images, labels, partition, _ = tiny_network_problem()
    landscape = Landscape(subset_size=20, iterations=5, probes=2)
    fabric, loop = federated_loop(network, images, labels, partition, FedAvg(), [landscape], num_classes=3)
    params, buffers = loop.global_model.params.clone(), loop.global_model.buffers.clone()
    rng = torch.get_rng_state()
    loop.module.train()
    landscape.measure(loop)
    assert torch.equal(loop.global_model.params, params) and torch.equal(loop.global_model.buffers, buffers)
    assert torch.equal(torch.get_rng_state(), rng)
    assert loop.module.training


@pytest.mark.parametrize("setting, value", [("subset_size", 0), ("iterations", 0), ("probes", 0), ("every", 0)])
def test_bad_settings_are_refused(setting, value):
    with pytest.raises(ConfigError, match=setting):
        Landscape(**{setting: value})


# In a run from the command line.

def callbacks_config(tmp_path: Path, *callbacks: dict) -> str:
    path = tmp_path / "diagnostics.yaml"
    path.write_text(yaml.safe_dump({"callbacks": list(callbacks)}))
    return str(path)


def final_checkpoint(out_dir: Path) -> dict:
    return torch.load(checkpoint_dir(out_dir) / "last.ckpt", weights_only=False)


@pytest.mark.slow
def test_a_run_with_the_landscape_measured_trains_the_same_model(tmp_path, reductions):
    config = callbacks_config(tmp_path, {"class_path": "fl_lightning.diagnostics.landscape.Landscape",
                                         "init_args": {"every": 2, "subset_size": 100, "iterations": 10,
                                                       "probes": 3}})
    main(["fit", *TINY, "--federation.rounds", "5", "--config", config, "--out_dir", str(tmp_path / "with")])
    main(["fit", *TINY, "--federation.rounds", "5", "--out_dir", str(tmp_path / "without")])

    measured, plain = final_checkpoint(tmp_path / "with"), final_checkpoint(tmp_path / "without")
    for name, tensor in plain["model"].items():
        assert torch.equal(measured["model"][name], tensor), name
    assert torch.equal(measured["rng"], plain["rng"])
    rows = read_metrics(tmp_path / "with")
    assert [row["round"] for row in rows if "hessian/trace" in row] == [2, 4, 5]  # every 2 and the last
    assert len(reductions) == 3
    for row in rows:
        if "hessian/trace" in row:
            assert row["hessian/lambda_max"] >= row["hessian/lambda_min"]
            assert row["hessian/convexity"] == pytest.approx(abs(row["hessian/lambda_max"] / row["hessian/lambda_min"]))
    plain_rows = read_metrics(tmp_path / "without")
    assert [row["train_loss"] for row in rows] == [row["train_loss"] for row in plain_rows]
