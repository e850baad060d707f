"""FedAvgM, FedAvg-M, FedCM, FedProx and FedSAM against direct reference computations
(full-batch gradients on the linear model, several rounds, partial participation)."""

import sys
from pathlib import Path

import pytest
import torch
from reference import SEED, LinearProblem, assert_close, small_setup

from fl_lightning.algorithms import SHORT_NAMES, FedAvg
from fl_lightning.algorithms.fedavg_m import FedAvgMomentum
from fl_lightning.algorithms.fedavgm import FedAvgM
from fl_lightning.algorithms.fedcm import FedCM
from fl_lightning.algorithms.fedprox import FedProx
from fl_lightning.algorithms.fedsam import FedSAM
from fl_lightning.clients.run import CLIENT_STREAM, batch_positions, seeded_generator
from fl_lightning.config import ClientOptimizerArgs, ModelArgs
from fl_lightning.errors import ConfigError
from fl_lightning.federation.aggregation import sample_clients
from fl_lightning.fit import fit
from fl_lightning.run_logging import read_metrics
from fl_lightning.server_optimizers import FedAdam, ServerSGD

LR = 0.05
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def sampled(round_index, setup):
    federation = setup["federation"]
    clients = sample_clients(SEED, round_index, federation.num_clients, federation.clients_per_round)
    assert len(clients) < federation.num_clients  # partial participation
    return clients


def sample_weights(problem, clients):
    total = sum(problem.num_samples(c) for c in clients)
    return {c: problem.num_samples(c) / total for c in clients}


def local_sgd(problem, x, client, steps, direction):
    """Plain SGD from x on the client's full batch: y <- y - LR * direction(y, gradient at y)."""
    y = x.clone()
    for _ in range(steps):
        y = y - LR * direction(y, problem.grad(y, client))
    return y


def test_all_baselines_register_their_short_names():
    assert {"fedavgm": FedAvgM, "fedavg_m": FedAvgMomentum, "fedcm": FedCM, "fedprox": FedProx,
            "fedsam": FedSAM}.items() <= SHORT_NAMES.items()


def test_fedprox_matches_reference(cifar_root, tmp_path):
    setup = small_setup(cifar_root, tmp_path)
    mu = 0.5  # large enough that a wrong sign or a missing term shows
    final = fit(algorithm=FedProx(mu=mu), client_optimizer=ClientOptimizerArgs(lr=LR),
                server_optimizer=ServerSGD(lr=0.8), **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    x = problem.initial_params()
    for r in range(setup["federation"].rounds):
        clients = sampled(r, setup)
        p = sample_weights(problem, clients)
        update = torch.zeros_like(x)
        for c in clients:
            y = local_sgd(problem, x, c, setup["federation"].local_epochs,
                          lambda y, g, x=x: g + mu * (y - x))
            update += p[c] * (y - x)
        x = x + 0.8 * update
    assert_close(final, x)


def test_fedavgm_matches_server_momentum_reference(cifar_root, tmp_path):
    setup = small_setup(cifar_root, tmp_path, rounds=4)
    beta, gamma = 0.7, 0.8
    final = fit(algorithm=FedAvgM(server_momentum=beta), client_optimizer=ClientOptimizerArgs(lr=LR),
                server_optimizer=ServerSGD(lr=gamma), **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    x = problem.initial_params()
    momentum = torch.zeros_like(x)
    for r in range(setup["federation"].rounds):
        clients = sampled(r, setup)
        p = sample_weights(problem, clients)
        d = sum(p[c] * (x - local_sgd(problem, x, c, setup["federation"].local_epochs, lambda y, g: g))
                for c in clients)
        momentum = beta * momentum + d
        x = x - gamma * momentum
    assert_close(final, x)


def test_fedavgm_resumes_its_server_momentum(cifar_root, tmp_path):
    """FedAvgM builds its own server optimizer; its momentum must still reach the checkpoint."""
    def run(out_dir, rounds, resume):
        setup = small_setup(cifar_root, out_dir, rounds=rounds, local_epochs=1)
        setup["resume"] = resume
        return fit(algorithm=FedAvgM(server_momentum=0.9), client_optimizer=ClientOptimizerArgs(lr=LR),
                   server_optimizer=ServerSGD(lr=0.5), **setup)

    run(tmp_path / "interrupted", 2, None)
    resumed = run(tmp_path / "interrupted", 4, "auto")
    torch.testing.assert_close(resumed, run(tmp_path / "uninterrupted", 4, None), rtol=0, atol=0)


@pytest.mark.parametrize("server_optimizer, field", [
    (ServerSGD(lr=0.5, momentum=0.5), "server_optimizer.momentum"),
    (FedAdam(), "server_optimizer"),
])
def test_fedavgm_refuses_a_server_optimizer_it_cannot_own(server_optimizer, field):
    with pytest.raises(ConfigError) as error:
        FedAvgM().server_optimizer_for(server_optimizer)
    assert error.value.field_name == field


def mixed_direction_reference(problem, setup, gradient_weight, gamma, batches=None):
    """FedAvg-M / FedCM written out: steps along w g + (1 - w) G with G the previous round's
    sum_i p_i (x - y_i) / (LR K_i), uniform p. `batches(r, c)` gives each step's sample indices
    (None: one full batch per local epoch)."""
    x = problem.initial_params()
    global_direction = torch.zeros_like(x)
    for r in range(setup["federation"].rounds):
        clients = sampled(r, setup)
        update, next_direction = torch.zeros_like(x), torch.zeros_like(x)
        for c in clients:
            y = x.clone()
            steps = ([None] * setup["federation"].local_epochs) if batches is None else batches(r, c)
            for samples in steps:
                g = problem.grad(y, c) if samples is None else problem.grad_on(y, samples)
                y = y - LR * (gradient_weight * g + (1 - gradient_weight) * global_direction)
            update += (y - x) / len(clients)
            next_direction += (x - y) / (LR * len(steps)) / len(clients)
        x = x + gamma * update
        global_direction = next_direction
    return x


@pytest.mark.parametrize("algorithm, gradient_weight", [
    (FedAvgMomentum(beta=0.3), 0.3),
    (FedAvgMomentum(), 0.1),
    (FedCM(alpha=0.3), 0.3),
    (FedCM(), 0.1),
])
def test_mixed_direction_methods_match_reference(cifar_root, tmp_path, algorithm, gradient_weight):
    setup = small_setup(cifar_root, tmp_path, rounds=4)
    final = fit(algorithm=algorithm, client_optimizer=ClientOptimizerArgs(lr=LR),
                server_optimizer=ServerSGD(lr=0.9), **setup)
    problem = LinearProblem(cifar_root, tmp_path)
    assert_close(final, mixed_direction_reference(problem, setup, gradient_weight, gamma=0.9))


def test_fedavg_m_divides_each_update_by_the_clients_own_step_count(cifar_root, tmp_path):
    """With local_epochs and mini-batches, K_i = ceil(n_i / B) differs between clients."""
    setup = small_setup(cifar_root, tmp_path, rounds=3, local_epochs=1, batch_size=15)
    final = fit(algorithm=FedAvgMomentum(beta=0.3), client_optimizer=ClientOptimizerArgs(lr=LR),
                server_optimizer=ServerSGD(lr=1.0), **setup)

    problem = LinearProblem(cifar_root, tmp_path)

    def batches(round_index, client):
        # The client's own draw of batches, as the product makes it (order of samples only).
        generator = seeded_generator(SEED, CLIENT_STREAM, round_index, client)
        positions = batch_positions(problem.num_samples(client), 15, None, 1, generator)
        return [problem.client_samples[client][p] for p in positions]

    step_counts = {len(batches(r, c)) for r in range(3) for c in sampled(r, setup)}
    assert len(step_counts) > 1
    assert_close(final, mixed_direction_reference(problem, setup, 0.3, gamma=1.0, batches=batches))


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


@pytest.mark.parametrize("make, field", [
    (lambda: FedProx(mu=-0.1), "algorithm.init_args.mu"),
    (lambda: FedSAM(rho=-0.1), "algorithm.init_args.rho"),
    (lambda: FedAvgM(server_momentum=1.0), "algorithm.init_args.server_momentum"),
    (lambda: FedAvgM(server_momentum=-0.1), "algorithm.init_args.server_momentum"),
    (lambda: FedAvgMomentum(beta=0.0), "algorithm.init_args.beta"),
    (lambda: FedAvgMomentum(beta=1.5), "algorithm.init_args.beta"),
    (lambda: FedCM(alpha=0.0), "algorithm.init_args.alpha"),
    (lambda: FedCM(alpha=-0.2), "algorithm.init_args.alpha"),
])
def test_bad_hyperparameters_are_config_errors(make, field):
    with pytest.raises(ConfigError) as error:
        make()
    assert error.value.field_name == field
