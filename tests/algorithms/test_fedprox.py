"""FedProx against a direct reference computation: local SGD on the loss plus the proximal term mu/2 |y - x|^2."""

import torch
from reference import LR, LinearProblem, assert_close, local_sgd, sample_weights, sampled, small_setup

from fl_lightning.algorithms.fedprox import FedProx
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.fit import fit
from fl_lightning.server_optimizers import ServerSGD


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
