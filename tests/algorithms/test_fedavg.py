"""FedAvg against a direct reference computation: local SGD with momentum and weight decay on full batches,
sample-weighted aggregation, a server step, several rounds of partial participation."""

import pytest
import torch
from reference import LinearProblem, assert_close, sampled, small_setup

from fl_lightning.algorithms import FedAvg
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.fit import fit
from fl_lightning.server_optimizers import ServerSGD


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
