"""FedAvg against a direct reference computation: local SGD with momentum and weight decay on full batches,
sample-weighted aggregation, a server step, several rounds of partial participation."""

import pytest
import torch
from reference import LinearProblem, assert_close, client_batches, sampled, small_setup, straggler_steps

from fl_lightning.algorithms import FedAvg
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.fit import fit
from fl_lightning.participation import Stragglers
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


def test_stragglers_do_the_first_of_their_steps_and_keep_their_weights(cifar_root, tmp_path):
    """A straggler trains on the first of the mini-batches it would have had; FedAvg still weights the
    clients by their samples."""
    stragglers = Stragglers(speeds=(0.3, 1.0), jitter=0.5, deadline=4)
    setup = small_setup(cifar_root, tmp_path, local_epochs=1, batch_size=10, stragglers=stragglers)
    final = fit(algorithm=FedAvg(), client_optimizer=ClientOptimizerArgs(lr=0.05), **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    x, steps_done = problem.initial_params(), set()
    for r in range(setup["federation"].rounds):
        clients = sampled(r, setup)
        total = sum(problem.num_samples(c) for c in clients)
        update = torch.zeros_like(x)
        for c in clients:
            batches = client_batches(problem, setup, r, c)
            steps = straggler_steps(len(batches), r, c, stragglers)
            steps_done.add((len(batches), steps))
            y = x.clone()
            for indices in batches[:steps]:
                y = y - 0.05 * problem.grad_on(y, indices)
            update += problem.num_samples(c) / total * (y - x)
        x = x + update
    assert any(steps < planned for planned, steps in steps_done) and len({s for _, s in steps_done}) > 2
    assert_close(final, x)
