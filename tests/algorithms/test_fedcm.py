"""FedCM against a direct reference computation: local steps along alpha g + (1 - alpha) G, G the previous
round's average update per step (the same client rule as FedAvg-M's, with its own default weight)."""

import pytest
from reference import assert_close, fit_with_mixed_direction

from fl_lightning.algorithms.fedcm import FedCM


@pytest.mark.parametrize("algorithm, gradient_weight", [(FedCM(alpha=0.3), 0.3), (FedCM(), 0.1)])
def test_fedcm_matches_reference(cifar_root, tmp_path, algorithm, gradient_weight):
    assert_close(*fit_with_mixed_direction(algorithm, gradient_weight, cifar_root, tmp_path))
