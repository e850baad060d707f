"""FedSAM against a direct reference computation (the ascent step, then the descent at the perturbed point), its
logged loss, and the BatchNorm statistics it leaves to the first pass."""

import sys

import pytest
import torch
from paths import EXAMPLES
from reference import LR, LinearProblem, assert_close, sample_weights, sampled, small_setup

from fl_lightning.algorithms import FedAvg
from fl_lightning.algorithms.fedsam import FedSAM
from fl_lightning.config import ClientOptimizerArgs, ModelArgs
from fl_lightning.fit import fit
from fl_lightning.run_logging import read_metrics
from fl_lightning.server_optimizers import ServerSGD


@pytest.mark.slow
def test_fedsam_matches_reference_and_logs_the_first_pass_loss(cifar_root, tmp_path):
    setup = small_setup(cifar_root, tmp_path)
    rho = 0.5
    final = fit(algorithm=FedSAM(rho=rho), client_optimizer=ClientOptimizerArgs(lr=LR),
                server_optimizer=ServerSGD(lr=0.8), **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    x = problem.initial_params()
    train_losses = []
    for r in range(setup["federation"].rounds):
        clients = sampled(r, setup)
        p = sample_weights(problem, clients)
        update, train_loss = torch.zeros_like(x), 0.0
        for c in clients:
            y, losses = x.clone(), []
            for _ in range(setup["federation"].local_epochs):
                losses.append(problem.loss(y, c).item())
                g = problem.grad(y, c)
                y = y - LR * problem.grad(y + rho * g / (g.norm() + 1e-12), c)
            update += p[c] * (y - x)
            train_loss += p[c] * sum(losses) / len(losses)
        x = x + 0.8 * update
        train_losses.append(train_loss)
    assert_close(final, x)
    logged = [row["train_loss"] for row in read_metrics(tmp_path)]
    assert logged == pytest.approx(train_losses, rel=1e-5)


@pytest.fixture
def example_model_importable(monkeypatch):
    """examples/ on the path, as PYTHONPATH=examples puts it; the example model forgotten afterwards."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    imported_before = "my_model" in sys.modules
    yield
    if not imported_before:
        sys.modules.pop("my_model", None)


@pytest.mark.slow
def test_fedsam_leaves_batchnorm_statistics_to_the_first_pass(cifar_root, tmp_path, example_model_importable):
    """One local step from x: the running stats come from the forward pass at x alone, so they
    equal FedAvg's, whatever the ascent step does to the parameters. The network is the small
    conv - BatchNorm - conv - BatchNorm example model: what is checked is FedSAM's second pass, for
    which any network whose BatchNorm inputs depend on the parameters does as well as a ResNet-18."""
    def running_stats(algorithm, out_dir):
        setup = small_setup(cifar_root, out_dir, rounds=1, num_clients=12, clients_per_round=1, local_epochs=1)
        setup["model"] = ModelArgs(name="my_model.make_net", norm="bn", options={"width": 4})
        fit(algorithm=algorithm, client_optimizer=ClientOptimizerArgs(lr=LR), **setup)
        model = torch.load(out_dir / "checkpoints" / "last.ckpt", weights_only=False)["model"]
        return {name: value for name, value in model.items() if "running" in name}

    sam_stats = running_stats(FedSAM(rho=1.0), tmp_path / "fedsam")
    fedavg_stats = running_stats(FedAvg(), tmp_path / "fedavg")
    assert sam_stats
    torch.testing.assert_close(sam_stats, fedavg_stats, rtol=0, atol=0)
