"""FedAvg and CTP-FL against direct reference computations (full-batch gradients, several rounds,
partial participation)."""

import pytest
import torch
from reference import SEED, LinearProblem, assert_close, small_setup

from fl_lightning.algorithms import CTPFL, FedAvg
from fl_lightning.config import ClientOptimizerArgs
from fl_lightning.federation import sample_clients
from fl_lightning.fit import fit
from fl_lightning.server_optimizers import ServerSGD


def sampled(round_index, setup):
    federation = setup["federation"]
    return sample_clients(SEED, round_index, federation.num_clients, federation.clients_per_round)


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


@pytest.mark.parametrize("span, local_epochs", [(0.0, 3), (0.3, 3), (None, 3), (0.3, 1)])
def test_ctpfl_matches_algorithm_1(cifar_root, tmp_path, span, local_epochs):
    setup = small_setup(cifar_root, tmp_path, local_epochs=local_epochs, rounds=4)
    gamma = 0.4
    final = fit(algorithm=CTPFL(span=span), server_optimizer=ServerSGD(lr=gamma), **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    h = gamma if span is None else span
    K = local_epochs
    t = [k * h / (K - 1) for k in range(K)] if K > 1 else [0.0]
    x, v = problem.initial_params(), None
    for r in range(setup["federation"].rounds):
        v_prev = torch.zeros_like(x) if v is None else v
        clients = sampled(r, setup)
        u = [sum(problem.grad(x - t[k] * v_prev, c) for k in range(K)) / K for c in clients]
        v = sum(u) / len(clients)  # uniform weights, the paper's default
        x = x - gamma * v
    assert_close(final, x)


def test_ctpfl_with_zero_span_is_minibatch_sgd(cifar_root, tmp_path):
    """h = 0: every query point is x, so v is the mean gradient at x."""
    setup = small_setup(cifar_root, tmp_path, local_epochs=2, rounds=2)
    final = fit(algorithm=CTPFL(span=0.0), server_optimizer=ServerSGD(lr=0.5), **setup)
    problem = LinearProblem(cifar_root, tmp_path)
    x = problem.initial_params()
    for r in range(2):
        clients = sampled(r, setup)
        x = x - 0.5 * sum(problem.grad(x, c) for c in clients) / len(clients)
    assert_close(final, x)


@pytest.mark.parametrize("model_name, weight_decay, clip_norm", [("linear", 0.0, None), ("lenet5", 1e-3, 0.5)])
def test_ctpfl_vectorised_clients_match_the_client_by_client_path(cifar_root, tmp_path, monkeypatch,
                                                                   model_name, weight_decay, clip_norm):
    """Mini-batches with augmentation, the same K for all: the one-pass-per-query-point path must
    give the same model as evaluating every client separately."""
    import fl_lightning.algorithms.ctpfl as ctpfl_module
    from fl_lightning.config import DataArgs, FederationArgs, ModelArgs

    passes = []
    original = ctpfl_module.group_loss_and_grads
    monkeypatch.setattr(ctpfl_module, "group_loss_and_grads",
                        lambda clients, *args: passes.append(len(clients)) or original(clients, *args))

    def run(vectorise, out_dir):
        setup = small_setup(cifar_root, out_dir)
        setup.update(model=ModelArgs(name=model_name, norm="none"),
                     data=DataArgs(name="cifar10", root=cifar_root, alpha=1.0, min_samples=10),
                     federation=FederationArgs(rounds=3, num_clients=5, clients_per_round=3, local_steps=4,
                                               batch_size=16, eval_every=3))
        algorithm = CTPFL(span=0.3, weight_decay=weight_decay, clip_norm=clip_norm, vectorise=vectorise)
        return fit(algorithm=algorithm, server_optimizer=ServerSGD(lr=0.5), **setup)

    one_by_one = run(False, tmp_path / "sequential")
    assert passes == []
    together = run(True, tmp_path / "vectorised")
    assert passes == [3] * 3 * 4  # 3 rounds x K = 4 query points, all 3 clients in each pass
    torch.testing.assert_close(together, one_by_one, rtol=1e-5, atol=1e-6)
