"""FedNova against a direct reference computation: each client's update normalised by its local
optimizer's distance per unit direction (plain SGD: its steps; momentum: the heavy-ball sum), the
server's step scaled by their weighted mean, under stragglers, cyclic participation and lost uploads;
and FedAvg when every client does the same work."""

import pytest
import torch
from reference import (
    LinearProblem,
    assert_close,
    client_batches,
    participation_pattern,
    sampled,
    small_setup,
    straggler_steps,
)

from fl_lightning.algorithms import FedAvg, FedNova
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.fit import fit
from fl_lightning.participation import Stragglers
from fl_lightning.server_optimizers import ServerSGD

LR = 0.05


def heavy_ball_distance(steps, momentum):
    """||a_i||_1 of the paper for momentum SGD, summed step by step: sum over m of (1 - rho^m) / (1 - rho)."""
    return sum(sum(momentum ** j for j in range(m)) for m in range(1, steps + 1))


@pytest.mark.slow
@pytest.mark.parametrize("momentum, participation", [(0.0, "uniform"), (0.5, "cyclic_with_dropouts")])
def test_fednova_matches_reference_under_stragglers(cifar_root, tmp_path, momentum, participation):
    stragglers = Stragglers(speeds=(0.3, 1.0), jitter=0.5)
    setup = small_setup(cifar_root, tmp_path, rounds=6, local_epochs=1, batch_size=10, eval_every=6,
                        stragglers=stragglers, **participation_pattern(participation, tmp_path))
    final = fit(algorithm=FedNova(), client_optimizer=ClientOptimizerArgs(lr=LR, momentum=momentum),
                server_optimizer=ServerSGD(lr=0.8), **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    x, distances = problem.initial_params(), set()
    for r in range(setup["federation"].rounds):
        clients = sampled(r, setup)
        total = sum(problem.num_samples(c) for c in clients)
        normalised, tau_eff = torch.zeros_like(x), 0.0
        for c in clients:
            batches = client_batches(problem, setup, r, c)
            batches = batches[:straggler_steps(len(batches), r, c, stragglers)]
            y, buffer = x.clone(), None
            for indices in batches:
                g = problem.grad_on(y, indices)
                buffer = g if buffer is None else momentum * buffer + g
                y = y - LR * buffer
            a = heavy_ball_distance(len(batches), momentum)
            p = problem.num_samples(c) / total
            normalised += p * (x - y) / a
            tau_eff += p * a
            distances.add(a)
        x = x - 0.8 * tau_eff * normalised
    assert len(distances) > 2
    assert_close(final, x)


def test_fednova_is_fedavg_when_every_client_does_the_same_work(cifar_root, tmp_path):
    setup = small_setup(cifar_root, tmp_path / "fednova", local_steps=3, local_epochs=None, batch_size=10)
    fednova = fit(algorithm=FedNova(), client_optimizer=ClientOptimizerArgs(lr=LR, momentum=0.5), **setup)
    setup["out_dir"] = tmp_path / "fedavg"
    fedavg = fit(algorithm=FedAvg(), client_optimizer=ClientOptimizerArgs(lr=LR, momentum=0.5), **setup)
    torch.testing.assert_close(fednova, fedavg, rtol=1e-5, atol=1e-6)
