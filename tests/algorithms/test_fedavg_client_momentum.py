"""FedAvg-M (client-side momentum) against a direct reference computation: local steps along
beta g + (1 - beta) G, G the previous round's average update per step, each client's update divided by
its own step count."""

import pytest
from reference import (
    LR,
    LinearProblem,
    assert_close,
    client_batches,
    fit_with_mixed_direction,
    mixed_direction_reference,
    sampled,
    small_setup,
)

from fl_lightning.algorithms.fedavg_client_momentum import FedAvgClientMomentum
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.fit import fit
from fl_lightning.server_optimizers import ServerSGD


@pytest.mark.parametrize("algorithm, gradient_weight",
                         [(FedAvgClientMomentum(beta=0.3), 0.3), (FedAvgClientMomentum(), 0.1)])
def test_fedavg_client_momentum_matches_reference(cifar_root, tmp_path, algorithm, gradient_weight):
    assert_close(*fit_with_mixed_direction(algorithm, gradient_weight, cifar_root, tmp_path))


def test_fedavg_client_momentum_divides_each_update_by_the_clients_own_step_count(cifar_root, tmp_path):
    """With local_epochs and mini-batches, K_i = ceil(n_i / B) differs between clients."""
    setup = small_setup(cifar_root, tmp_path, rounds=3, local_epochs=1, batch_size=15)
    final = fit(algorithm=FedAvgClientMomentum(beta=0.3), client_optimizer=ClientOptimizerArgs(lr=LR),
                server_optimizer=ServerSGD(lr=1.0), **setup)

    problem = LinearProblem(cifar_root, tmp_path)

    def batches(round_index, client):
        return client_batches(problem, setup, round_index, client)

    step_counts = {len(batches(r, c)) for r in range(3) for c in sampled(r, setup)}
    assert len(step_counts) > 1
    assert_close(final, mixed_direction_reference(problem, setup, 0.3, gamma=1.0, batches=batches))
