"""FedAvgM (server-side momentum) against a direct reference computation: server momentum on the aggregated
update, kept across a resume, and the server optimizers it cannot own refused."""

import pytest
import torch
from reference import LR, LinearProblem, assert_close, local_sgd, sample_weights, sampled, small_setup

from fl_lightning.algorithms.fedavg_server_momentum import FedAvgServerMomentum
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.errors import ConfigError
from fl_lightning.fit import fit
from fl_lightning.server_optimizers import FedAdam, ServerSGD


def test_fedavg_server_momentum_matches_server_momentum_reference(cifar_root, tmp_path):
    setup = small_setup(cifar_root, tmp_path, rounds=4)
    beta, gamma = 0.7, 0.8
    final = fit(algorithm=FedAvgServerMomentum(server_momentum=beta), client_optimizer=ClientOptimizerArgs(lr=LR),
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


def test_fedavg_server_momentum_resumes_its_server_momentum(cifar_root, tmp_path):
    """FedAvgM builds its own server optimizer; its momentum must still reach the checkpoint."""
    def run(out_dir, rounds, resume):
        setup = small_setup(cifar_root, out_dir, rounds=rounds, local_epochs=1)
        setup["resume"] = resume
        return fit(algorithm=FedAvgServerMomentum(server_momentum=0.9), client_optimizer=ClientOptimizerArgs(lr=LR),
                   server_optimizer=ServerSGD(lr=0.5), **setup)

    run(tmp_path / "interrupted", 2, None)
    resumed = run(tmp_path / "interrupted", 4, "auto")
    torch.testing.assert_close(resumed, run(tmp_path / "uninterrupted", 4, None), rtol=0, atol=0)


@pytest.mark.parametrize("server_optimizer, field", [
    (ServerSGD(lr=0.5, momentum=0.5), "server_optimizer.momentum"),
    (FedAdam(), "server_optimizer"),
])
def test_fedavg_server_momentum_refuses_a_server_optimizer_it_cannot_own(server_optimizer, field):
    with pytest.raises(ConfigError) as error:
        FedAvgServerMomentum().server_optimizer_for(server_optimizer)
    assert error.value.field_name == field
