"""FedCM against a direct reference computation: local steps along alpha g + (1 - alpha) G, G the previous
round's average update per step (the same client rule as FedAvg-M's, with its own default weight)."""

import pytest
from reference import LR, LinearProblem, assert_close, mixed_direction_reference, small_setup

from fl_lightning.algorithms.fedcm import FedCM
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.fit import fit
from fl_lightning.server_optimizers import ServerSGD


@pytest.mark.parametrize("algorithm, gradient_weight", [(FedCM(alpha=0.3), 0.3), (FedCM(), 0.1)])
def test_fedcm_matches_reference(cifar_root, tmp_path, algorithm, gradient_weight):
    setup = small_setup(cifar_root, tmp_path, rounds=4)
    final = fit(algorithm=algorithm, client_optimizer=ClientOptimizerArgs(lr=LR),
                server_optimizer=ServerSGD(lr=0.9), **setup)
    problem = LinearProblem(cifar_root, tmp_path)
    assert_close(final, mixed_direction_reference(problem, setup, gradient_weight, gamma=0.9))
