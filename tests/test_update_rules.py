"""FedAvg and CTP-FL against direct reference computations (full-batch gradients, several rounds,
partial participation)."""

import pytest
import torch
from reference import SEED, LinearProblem, assert_close, small_setup

from fl_lightning.algorithms import CTPFL, FedAvg
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.federation.aggregation import sample_clients
from fl_lightning.fit import fit
from fl_lightning.server_optimizers import ServerSGD


def sampled(round_index, setup):
    federation = setup["federation"]
    return sample_clients(SEED, round_index, federation.num_clients, federation.clients_per_round)


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.5, 1e-3)])
def test_fedavg_matches_reference(cifar_root, tmp_path, momentum, weight_decay):
    setup = small_setup(cifar_root, tmp_path)
    client_optimizer = ClientOptimizerArgs(lr=0.05, momentum=momentum, weight_decay=weight_decay)
    final = fit(algorithm=FedAvg(), client_optimizer=client_optimizer, server_optimizer=ServerSGD(lr=0.7), **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    x = problem.initial_params()
    for r in range(setup["federation"].rounds):
        clients = sampled(r, setup)
        assert len(clients) < setup["federation"].num_clients  # partial participation
        total = sum(problem.num_samples(c) for c in clients)
        update = torch.zeros_like(x)
        for c in clients:
            y, buf = x.clone(), None
            for _ in range(setup["federation"].local_epochs):  # one full batch per epoch
                d = problem.grad(y, c) + weight_decay * y
                buf = d if buf is None else momentum * buf + d
                y = y - 0.05 * (buf if momentum else d)
            update += problem.num_samples(c) / total * (y - x)
        x = x + 0.7 * update
    assert_close(final, x)


@pytest.mark.slow
@pytest.mark.parametrize("span, local_epochs", [(0.0, 3), (0.3, 3), (None, 3), (0.3, 1)])
def test_ctpfl_matches_algorithm_1(cifar_root, tmp_path, span, local_epochs):
    setup = small_setup(cifar_root, tmp_path, local_epochs=local_epochs, rounds=4)
    gamma = 0.4
    final = fit(algorithm=CTPFL(span=span), server_optimizer=ServerSGD(lr=gamma), **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    h = gamma if span is None else span
    K = local_epochs
    t = [k * h / (K - 1) for k in range(K)] if K > 1 else [0.0]
    x, v = problem.initial_params(), None
    for r in range(setup["federation"].rounds):
        v_prev = torch.zeros_like(x) if v is None else v
        clients = sampled(r, setup)
        u = [sum(problem.grad(x - t[k] * v_prev, c) for k in range(K)) / K for c in clients]
        v = sum(u) / len(clients)  # uniform weights, the paper's default
        x = x - gamma * v
    assert_close(final, x)


def test_ctpfl_with_zero_span_is_minibatch_sgd(cifar_root, tmp_path):
    """h = 0: every query point is x, so v is the mean gradient at x."""
    setup = small_setup(cifar_root, tmp_path, local_epochs=2, rounds=2)
    final = fit(algorithm=CTPFL(span=0.0), server_optimizer=ServerSGD(lr=0.5), **setup)
    problem = LinearProblem(cifar_root, tmp_path)
    x = problem.initial_params()
    for r in range(2):
        clients = sampled(r, setup)
        x = x - 0.5 * sum(problem.grad(x, c) for c in clients) / len(clients)
    assert_close(final, x)
