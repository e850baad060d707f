"""SCAFFOLD against a direct reference computation: control variates kept across skipped rounds, the local
optimizer's momentum and Nesterov, effective step counts, and the controls in the checkpoint."""

import pytest
import torch
from reference import (
    LinearProblem,
    assert_close,
    client_batches,
    last_checkpoint,
    participation_pattern,
    returning_after_a_gap,
    sampled,
    small_setup,
)

from fl_lightning.algorithms.scaffold import SCAFFOLD
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.fit import fit
from fl_lightning.server_optimizers import ServerSGD


def distance_along_constant_direction(num_steps, lr, momentum, nesterov):
    """How far the local optimizer's recurrence moves in num_steps along a direction of 1."""
    position, buffer = 0.0, None
    for _ in range(num_steps):
        buffer = 1.0 if buffer is None else momentum * buffer + 1.0
        position += lr * ((1.0 + momentum * buffer if nesterov else buffer) if momentum else 1.0)
    return position


@pytest.mark.slow
@pytest.mark.parametrize("momentum, nesterov, effective_steps, participation", [
    (0.0, False, False, "uniform"), (0.9, False, False, "uniform"), (0.9, False, True, "cyclic_with_dropouts"),
    (0.5, True, True, "long_absences"), (0.0, False, False, "cyclic_with_dropouts")])
def test_scaffold_matches_reference_with_controls_kept_across_skipped_rounds(
        cifar_root, tmp_path, momentum, nesterov, effective_steps, participation):
    # Mini-batches of 20 give clients of different sizes different step counts K_i.
    setup = small_setup(cifar_root, tmp_path, rounds=6, local_epochs=1, batch_size=20, eval_every=6,
                        **participation_pattern(participation, tmp_path))
    lr, gamma = 0.05, 0.8
    final = fit(algorithm=SCAFFOLD(effective_steps=effective_steps),
                client_optimizer=ClientOptimizerArgs(lr=lr, momentum=momentum, nesterov=nesterov),
                server_optimizer=ServerSGD(lr=gamma), **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    num_clients = setup["federation"].num_clients
    x = problem.initial_params()
    server_control = torch.zeros_like(x)
    client_controls = {}
    step_counts = set()
    for r in range(setup["federation"].rounds):
        clients = sampled(r, setup)
        mean_change, control_change = torch.zeros_like(x), torch.zeros_like(x)
        for c in clients:
            control = client_controls.get(c, torch.zeros_like(x))
            y, buffer = x.clone(), None
            batches = client_batches(problem, setup, r, c)
            for indices in batches:
                d = problem.grad_on(y, indices) - control + server_control
                buffer = d if buffer is None else momentum * buffer + d
                y = y - lr * ((d + momentum * buffer if nesterov else buffer) if momentum else d)
            step_length = (distance_along_constant_direction(len(batches), lr, momentum, nesterov)
                           if effective_steps else len(batches) * lr)
            new_control = control - server_control + (x - y) / step_length
            mean_change += (y - x) / len(clients)  # uniform weights over those that reported, the paper's default
            control_change += new_control - control
            client_controls[c] = new_control
            step_counts.add(len(batches))
        x = x + gamma * mean_change
        # The paper's partial participation: c <- c + |S| / N * mean over S of (c_i+ - c_i), S those that reported.
        server_control = server_control + len(clients) / num_clients * (control_change / max(len(clients), 1))
    assert len(step_counts) > 1
    assert returning_after_a_gap(setup)
    assert_close(final, x)

    checkpoint = last_checkpoint(tmp_path)
    assert_close(checkpoint["algorithm"]["server_state"]["control"], server_control)
    assert set(checkpoint["client_states"]) == set(client_controls)
    for c, control in client_controls.items():
        assert_close(checkpoint["client_states"][c]["control"], control)
