"""FedDyn against a direct reference computation: each client's linear term h_k, the server's h, and both in the
checkpoint."""

import pytest
import torch
from reference import (
    LinearProblem,
    assert_close,
    last_checkpoint,
    participation_pattern,
    returning_after_a_gap,
    sampled,
    small_setup,
)

from fl_lightning.algorithms.feddyn import FedDyn
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.fit import fit


@pytest.mark.parametrize("alpha, participation", [
    (0.01, "uniform"), (0.3, "uniform"), (0.1, "cyclic_with_dropouts"), (0.1, "long_absences")])
def test_feddyn_matches_reference(cifar_root, tmp_path, alpha, participation):
    setup = small_setup(cifar_root, tmp_path, rounds=6, eval_every=6, **participation_pattern(participation, tmp_path))
    lr, epochs = 0.05, setup["federation"].local_epochs
    final = fit(algorithm=FedDyn(alpha=alpha), client_optimizer=ClientOptimizerArgs(lr=lr), **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    num_clients = setup["federation"].num_clients
    x = problem.initial_params()
    h = torch.zeros_like(x)
    client_h = {}
    for r in range(setup["federation"].rounds):
        local_models = []
        for c in sampled(r, setup):
            h_c = client_h.get(c, torch.zeros_like(x))
            y = x.clone()
            for _ in range(epochs):  # one full batch per epoch
                y = y - lr * (problem.grad(y, c) - h_c + alpha * (y - x))
            client_h[c] = h_c - alpha * (y - x)
            local_models.append(y)
        if not local_models:  # no upload arrived: the server keeps its model and h
            continue
        # The paper's partial participation: h <- h - alpha / N * sum over those that reported of (y_k - x).
        h = h - alpha / num_clients * sum(y - x for y in local_models)
        x = sum(local_models) / len(local_models) - h / alpha
    assert returning_after_a_gap(setup)
    assert_close(final, x)

    checkpoint = last_checkpoint(tmp_path)
    assert_close(checkpoint["algorithm"]["server_state"]["h"], h)
    for c, h_c in client_h.items():
        assert_close(checkpoint["client_states"][c]["h_k"], h_c)
