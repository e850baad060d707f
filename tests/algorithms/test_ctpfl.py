"""CTP-FL against Algorithm 1 of the paper written out: K gradients at the points predicted along the previous
server direction, uniform aggregation, one server step."""

import numpy as np
import pytest
import torch
from reference import LinearProblem, assert_close, sampled, small_setup

from fl_lightning.algorithms import CTPFL
from fl_lightning.config import FederationArgs
from fl_lightning.errors import ConfigError
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


def test_local_epochs_are_refused_where_the_clients_sizes_give_them_unequal_steps():
    # K_i = ceil(n_i / B): sizes 21 to 30 all give 3 steps of 10; a client of 31 gives 4.
    equal = np.arange(21, 31)
    federation = FederationArgs(num_clients=len(equal) + 1, clients_per_round=2, local_epochs=1, batch_size=10)
    CTPFL().check_federation(federation, equal)
    with pytest.raises(ConfigError, match="from 3 to 4 local steps"):
        CTPFL().check_federation(federation, np.append(equal, 31))
