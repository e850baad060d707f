"""CTP-FL against Algorithm 1 of the paper written out: K gradients at the points predicted along the previous
server direction, uniform aggregation, one server step."""

import pytest
import torch
from reference import LinearProblem, assert_close, sampled, small_setup

from fl_lightning.algorithms import CTPFL
from fl_lightning.fit import fit
from fl_lightning.server_optimizers import ServerSGD


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
