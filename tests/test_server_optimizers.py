"""Server optimizers against the recurrences written out (Reddi et al. 2021, Algorithm 2; heavy-ball
and Nesterov SGD), under FedAvg and CTP-FL; their hyperparameter checks; their state across a
resume."""

import pytest
import torch
from reference import SEED, LinearProblem, assert_close, small_setup

from fl_lightning.algorithms import CTPFL, FedAvg
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.errors import ConfigError
from fl_lightning.federation.aggregation import sample_clients
from fl_lightning.fit import fit
from fl_lightning.server_optimizers import FedAdagrad, FedAdam, FedYogi, ServerSGD

LR = 0.05
BETA1, BETA2, TAU, SERVER_LR = 0.8, 0.9, 0.05, 0.03


def adaptive_step(name):
    """One server step of FedAdagrad / FedAdam / FedYogi on Delta = the averaged (y_i - x);
    state (m, v) starts at (0, tau^2)."""
    second_moments = {
        "adagrad": lambda v, d2: v + d2,
        "adam": lambda v, d2: BETA2 * v + (1 - BETA2) * d2,
        "yogi": lambda v, d2: v - (1 - BETA2) * d2 * torch.sign(v - d2),
    }

    def step(x, delta, state):
        m = BETA1 * state.get("m", torch.zeros_like(x)) + (1 - BETA1) * delta
        v = second_moments[name](state.get("v", torch.full_like(x, TAU**2)), delta * delta)
        state.update(m=m, v=v)
        return x + SERVER_LR * m / (v.sqrt() + TAU)

    return step


def nesterov_step(lr, momentum):
    def step(x, delta, state):
        pseudo_gradient = -delta
        buffer = momentum * state.get("buffer", torch.zeros_like(x)) + pseudo_gradient
        state["buffer"] = buffer
        return x - lr * (pseudo_gradient + momentum * buffer)

    return step


OPTIMIZERS = {
    "adagrad": (lambda: FedAdagrad(lr=SERVER_LR, beta1=BETA1, beta2=BETA2, tau=TAU), adaptive_step("adagrad")),
    "adam": (lambda: FedAdam(lr=SERVER_LR, beta1=BETA1, beta2=BETA2, tau=TAU), adaptive_step("adam")),
    "yogi": (lambda: FedYogi(lr=SERVER_LR, beta1=BETA1, beta2=BETA2, tau=TAU), adaptive_step("yogi")),
    "nesterov": (lambda: ServerSGD(lr=0.6, momentum=0.7, nesterov=True), nesterov_step(0.6, 0.7)),
}


def fedavg_delta(problem, x, clients, local_epochs):
    """sum_i p_i (y_i - x), p by sample counts, y_i from full-batch local SGD."""
    total = sum(problem.num_samples(c) for c in clients)
    delta = torch.zeros_like(x)
    for c in clients:
        y = x.clone()
        for _ in range(local_epochs):
            y = y - LR * problem.grad(y, c)
        delta += problem.num_samples(c) / total * (y - x)
    return delta


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_server_optimizer_under_fedavg_matches_reference(cifar_root, tmp_path, name):
    make_optimizer, reference_step = OPTIMIZERS[name]
    setup = small_setup(cifar_root, tmp_path, rounds=4)
    final = fit(algorithm=FedAvg(), client_optimizer=ClientOptimizerArgs(lr=LR), server_optimizer=make_optimizer(),
                **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    x, state = problem.initial_params(), {}
    federation = setup["federation"]
    for r in range(federation.rounds):
        clients = sample_clients(SEED, r, federation.num_clients, federation.clients_per_round)
        x = reference_step(x, fedavg_delta(problem, x, clients, federation.local_epochs), state)
    assert_close(final, x)


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_server_optimizer_under_ctpfl_matches_reference(cifar_root, tmp_path, name):
    """CTP-FL hands the server the mean gradient along the shared path u (Delta = -u), and its next
    query points follow the step the server took: v = (x_previous - x) / lr."""
    make_optimizer, reference_step = OPTIMIZERS[name]
    span, K = 0.5, 3
    optimizer = make_optimizer()
    setup = small_setup(cifar_root, tmp_path, rounds=4, local_epochs=K)
    final = fit(algorithm=CTPFL(span=span), server_optimizer=optimizer, **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    x, state = problem.initial_params(), {}
    v = torch.zeros_like(x)
    federation = setup["federation"]
    for r in range(federation.rounds):
        clients = sample_clients(SEED, r, federation.num_clients, federation.clients_per_round)
        u = sum(problem.grad(x - k * span / (K - 1) * v, c) for c in clients for k in range(K)) / (K * len(clients))
        x, previous = reference_step(x, -u, state), x
        v = (previous - x) / optimizer.lr
    assert_close(final, x)


@pytest.mark.parametrize("make, field", [
    (lambda: ServerSGD(lr=0.0), "server_optimizer.lr"),
    (lambda: ServerSGD(lr=-1.0), "server_optimizer.lr"),
    (lambda: ServerSGD(momentum=1.0), "server_optimizer.momentum"),
    (lambda: ServerSGD(momentum=-0.1), "server_optimizer.momentum"),
    (lambda: ServerSGD(nesterov=True), "server_optimizer.momentum"),
    (lambda: FedAdam(lr=0.0), "server_optimizer.lr"),
    (lambda: FedAdam(beta1=1.0), "server_optimizer.beta1"),
    (lambda: FedAdam(beta2=-0.5), "server_optimizer.beta2"),
    (lambda: FedYogi(beta2=1.0), "server_optimizer.beta2"),
    (lambda: FedYogi(tau=0.0), "server_optimizer.tau"),
    (lambda: FedAdagrad(tau=-1e-3), "server_optimizer.tau"),
    (lambda: FedAdagrad(lr=-0.1), "server_optimizer.lr"),
])
def test_bad_hyperparameters_are_config_errors(make, field):
    with pytest.raises(ConfigError) as error:
        make()
    assert error.value.field_name == field


@pytest.mark.parametrize("make_algorithm, make_optimizer", [
    (FedAvg, OPTIMIZERS["adam"][0]),
    (FedAvg, OPTIMIZERS["yogi"][0]),
    (lambda: CTPFL(span=0.5), OPTIMIZERS["nesterov"][0]),
])
def test_optimizer_state_survives_a_resume(cifar_root, tmp_path, make_algorithm, make_optimizer):
    """Two rounds, then a resume to four in the same folder, equals four rounds in one go."""
    def run(out_dir, rounds, resume):
        setup = small_setup(cifar_root, out_dir, rounds=rounds, local_epochs=2)
        setup["resume"] = resume
        return fit(algorithm=make_algorithm(), client_optimizer=ClientOptimizerArgs(lr=LR),
                   server_optimizer=make_optimizer(), **setup)

    run(tmp_path / "interrupted", 2, None)
    resumed = run(tmp_path / "interrupted", 4, "auto")
    torch.testing.assert_close(resumed, run(tmp_path / "uninterrupted", 4, None), rtol=0, atol=0)
