"""CTP-FL's displacement-bias diagnostic: the batches it looks at are the client's own; on a quadratic
with full participation the direction is unbiased for the path-averaged gradient (eq. 12) and the
measured bias is -(h/2) H v^r (eq. 14); a zero span measures no bias on a BatchNorm network with
augmentation; and a run with the diagnostics on trains bitwise the same model, on one rank and two."""

import importlib.util
import os
import sys
from functools import partial
from pathlib import Path

import numpy as np
import processes
import pytest
import torch
from diagnostic_problems import (
    TINY,
    Center,
    QuadraticModule,
    callbacks_config,
    federated_loop,
    final_checkpoint,
    run_rounds,
    symmetric_matrix,
    tiny_network_problem,
)
from paths import REPOSITORY
from torch import nn

from fl_lightning.algorithms import CTPFL, FedAvg
from fl_lightning.clients.run import CLIENT_STREAM, batch_positions, seeded_generator
from fl_lightning.commands.main import main
from fl_lightning.diagnostics.base import DIAG_COUNTERS, DIAG_GRAD_EVALS
from fl_lightning.diagnostics.ctpfl import DisplacementBias
from fl_lightning.errors import ConfigError
from fl_lightning.federation.costs import CLIENT_SECONDS, COUNTERS
from fl_lightning.module import ClassificationModule
from fl_lightning.run_logging import read_metrics

DIMENSION, CLIENTS, SAMPLES_PER_CLIENT = 5, 4, 12
HESSIAN = symmetric_matrix([-0.5, 0.3, 1.0, 2.0, 4.0], seed=2)
CTPFL_METRICS = {"ctpfl/bias", "ctpfl/relative_bias", "ctpfl/client_bias", "ctpfl/cosine", "ctpfl/gradient_norm",
                 "ctpfl/seconds"}


def quadratic_loop(span: float, callbacks: list, weight_decay: float = 0.0, server_lr: float = 0.2):
    """CTP-FL on F_i(x) = mean over client i's centres c of 1/2 (x - c)^T A (x - c): every client's
    centres lie in its own range (heterogeneous clients), every batch has Hessian A."""
    generator = torch.Generator().manual_seed(0)
    images = torch.cat([torch.randint(60 * i, 60 * i + 60, (SAMPLES_PER_CLIENT, 1, 1, DIMENSION), dtype=torch.uint8,
                                      generator=generator) for i in range(CLIENTS)])
    partition = [np.arange(i * SAMPLES_PER_CLIENT, (i + 1) * SAMPLES_PER_CLIENT) for i in range(CLIENTS)]
    fabric, loop = federated_loop(Center(len(HESSIAN)), images, torch.zeros(len(images), dtype=torch.long),
                                  partition, CTPFL(span=span, weight_decay=weight_decay), callbacks, local_steps=4,
                                  batch_size=2, server_lr=server_lr,
                                  module_type=partial(QuadraticModule, hessian=HESSIAN))
    centres = loop.evaluation.test_transform(images).flatten(1).double()
    # F = (1/N) sum_i F_i (uniform weights, CTP-FL's default): grad F(z) = A (z - mean of client means).
    mean_centre = torch.stack([centres[p].mean(0) for p in partition]).mean(0)
    return fabric, loop, mean_centre


def global_gradient(z: torch.Tensor, mean_centre: torch.Tensor, weight_decay: float = 0.0) -> torch.Tensor:
    return HESSIAN @ (z.double() - mean_centre) + weight_decay * z.double()


def augmented_ctpfl_client():
    """A CTP-FL loop over the tiny network, client 2 of its round 7 (5 steps of 4 augmented images), and
    the clients' partition."""
    module, images, labels, partition, _ = tiny_network_problem()
    _, loop = federated_loop(module, images, labels, partition, CTPFL(), [], local_steps=5, batch_size=4,
                             augment=True, num_classes=3)
    return loop, loop.trainer.client_round(2, 7, {}, loop.server_state), partition


def test_batches_looked_at_again_are_the_clients_own_and_leave_its_generator_alone():
    loop, client, _ = augmented_ctpfl_client()
    trained = list(client.batches())
    state = client.execution.generator.get_state()
    replayed = list(client.batches())
    assert torch.equal(client.execution.generator.get_state(), state)
    assert len(replayed) == len(trained) == 5
    for (inputs, targets), (again, again_targets) in zip(trained, replayed):
        assert torch.equal(inputs, again) and torch.equal(targets, again_targets)
    # Augmentation is on: the same samples without the same crops and flips would differ.
    plain, _ = loop.trainer.training_batch(client.execution.sample_indices[client.execution.positions[0]])
    assert not torch.equal(plain, trained[0][0])


def test_what_a_diagnostic_asks_a_client_leaves_its_round_as_it_was():
    loop, client, partition = augmented_ctpfl_client()
    trained = list(client.batches())
    state, buffers = client.execution.generator.get_state(), client.buffers.clone()
    global_buffers = loop.global_model.buffers.clone()  # BatchNorm's running statistics
    params = client.global_params + 0.1
    # The gradient a training pass takes (from the global buffers, as this client's are now), but
    # neither the client's buffers, nor its losses, nor the global buffers change.
    _, expected = client.loss_and_grad(params, trained[0], training_pass=False)
    assert torch.equal(client.gradient_at(params, trained[0]), expected)
    assert client.losses == [] and torch.equal(client.buffers, buffers)
    assert torch.equal(loop.global_model.buffers, global_buffers)
    # Batches drawn at the training positions from a generator where training's stood after the
    # batch order are the training batches: drawn as training draws them.
    generator = seeded_generator(loop.inputs.settings.seed, CLIENT_STREAM, 7, 2)
    batch_positions(client.num_samples, 4, 5, None, generator)
    for (inputs, targets), (drawn, drawn_targets) in zip(trained, client.draw_batches(client.execution.positions,
                                                                                      generator)):
        assert torch.equal(inputs, drawn) and torch.equal(targets, drawn_targets)
    seed = loop.inputs.settings.seed
    assert torch.equal(client.generator(1001).get_state(), seeded_generator(seed, 1001, 7, 2).get_state())
    assert torch.equal(client.execution.generator.get_state(), state)
    assert loop.trainer.training_pool().tolist() == sorted(int(i) for part in partition for i in part)


@pytest.mark.parametrize("span, weight_decay", [(0.4, 0.0), (1.2, 0.0), (0.4, 0.1)])
def test_the_measured_bias_on_a_quadratic_is_minus_h_over_2_H_v(span, weight_decay):
    """Eq. 14: on a quadratic, H^r = grad F(x^r) - (h/2) H v^r exactly; on shared batches the
    measured difference v^{r+1} - g(x^r) is that term for every draw of the batches."""
    diagnostic = DisplacementBias(every=1)
    fabric, loop, _ = quadratic_loop(span, [diagnostic], weight_decay)
    fabric.call("on_fit_start", fabric, loop)
    curvature = HESSIAN + weight_decay * torch.eye(DIMENSION, dtype=torch.float64)  # weight decay adds wd I
    for round_index in range(4):
        previous = loop.server_state.tensors["direction"].clone().double()  # v^r
        fabric.call("on_round_start", fabric, loop, round_index)
        metrics = loop.run_round(round_index)
        fabric.call("on_round_end", fabric, loop, metrics)
        measured = loop.server_state.tensors["direction"].double() - diagnostic.gradient.double()
        expected = -span / 2 * curvature @ previous
        torch.testing.assert_close(measured, expected, atol=2e-5, rtol=1e-4)
        assert metrics["ctpfl/bias"] == pytest.approx(expected.norm().item(), abs=2e-5, rel=1e-4)
        assert CTPFL_METRICS <= set(metrics)
        if round_index == 0:
            assert "ctpfl/bias_curvature" not in metrics  # v^0 = 0: no displacement yet
        else:
            ratio = (curvature @ previous).norm() / previous.norm()
            assert metrics["ctpfl/bias_curvature"] == pytest.approx(ratio.item(), rel=1e-3)
            assert metrics["ctpfl/bias_curvature"] <= torch.linalg.eigvalsh(curvature).abs().max().item() + 1e-4


@pytest.mark.slow
def test_the_direction_is_unbiased_for_the_path_averaged_gradient_under_full_participation():
    """Eq. 12: with every client taking part, E[v^{r+1} | x^r, v^r] = (1/K) sum_k grad F(z_k^r),
    however different the clients; it is not grad F(x^r). The diagnostic's g(x^r) is unbiased for
    grad F(x^r). The same (x^r, v^r) is set before each of many rounds, whose batches differ."""
    span = 1.0
    diagnostic = DisplacementBias(every=1)
    fabric, loop, mean_centre = quadratic_loop(span, [diagnostic])
    fabric.call("on_fit_start", fabric, loop)
    x = torch.tensor([0.3, -0.2, 0.5, 0.1, -0.4])
    v = torch.tensor([1.0, -0.5, 0.25, 0.8, -1.2])
    directions, gradients = [], []
    # 100 rounds: the bias of the directions against grad F(x^r) is then over 200 standard errors.
    for round_index in range(100):
        loop.global_model.params.copy_(x)
        loop.server_state.tensors["direction"] = v.clone()
        fabric.call("on_round_start", fabric, loop, round_index)
        metrics = loop.run_round(round_index)
        fabric.call("on_round_end", fabric, loop, metrics)
        directions.append(loop.server_state.tensors["direction"].double())
        gradients.append(diagnostic.gradient.double())
    directions, gradients = torch.stack(directions), torch.stack(gradients)
    offsets = [k * span / 3 for k in range(4)]  # t_k = k h / (K - 1), K = 4
    path_average = torch.stack([global_gradient(x - t * v, mean_centre) for t in offsets]).mean(0)
    at_x = global_gradient(x, mean_centre)

    def within_noise(samples: torch.Tensor, expected: torch.Tensor) -> bool:
        standard_error = samples.std(0) / len(samples) ** 0.5
        return bool(((samples.mean(0) - expected).abs() <= 5 * standard_error + 1e-6).all())

    assert within_noise(directions, path_average)
    assert within_noise(gradients, at_x)
    assert not within_noise(directions, at_x)  # the bias is far larger than the noise here
    torch.testing.assert_close(path_average - at_x, -span / 2 * HESSIAN @ v.double())


class NoBufferNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@pytest.mark.slow
@pytest.mark.parametrize("network, client_path", [("batchnorm", "loop"), ("batchnorm", "grouped"),
                                                  ("no buffers", "grouped")])
def test_a_zero_span_measures_no_bias(network, client_path):
    """h = 0 puts every query point at x^r: the gradients at x^r on the client's own batches are the
    clients' own, so the bias is zero (BatchNorm's batch statistics and augmentation included)."""
    module, images, labels, partition, _ = tiny_network_problem()
    if network == "no buffers":
        torch.manual_seed(0)
        module = ClassificationModule(NoBufferNet(), num_classes=3)
    diagnostic = DisplacementBias(every=1)
    fabric, loop = federated_loop(module, images, labels, partition, CTPFL(span=0.0), [diagnostic],
                                  local_steps=3, batch_size=4, augment=True, num_classes=3, client_path=client_path)
    for metrics in run_rounds(fabric, loop, 3):
        assert metrics["ctpfl/bias"] <= 1e-6 * metrics["ctpfl/gradient_norm"]
        assert metrics["ctpfl/cosine"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["ctpfl/client_bias"] <= 1e-6 * metrics["ctpfl/gradient_norm"]
        assert "ctpfl/bias_curvature" not in metrics  # h |v^r| = 0


def test_a_run_of_another_algorithm_is_refused():
    module, images, labels, partition, _ = tiny_network_problem()
    fabric, loop = federated_loop(module, images, labels, partition, FedAvg(), [DisplacementBias()], num_classes=3)
    with pytest.raises(ConfigError, match="callbacks.DisplacementBias: expected a CTP-FL run"):
        run_rounds(fabric, loop, 1)


DIAGNOSTICS = ({"class_path": "fl_lightning.diagnostics.ctpfl.DisplacementBias", "init_args": {"every": 2}},
               {"class_path": "fl_lightning.diagnostics.landscape.Landscape",
                "init_args": {"every": 3, "subset_size": 100, "iterations": 10, "probes": 3}})
CTPFL_RUN = [*TINY, "--algorithm", "ctpfl", "--algorithm.span", "0.3", "--server_optimizer.lr", "0.3",
             "--federation.rounds", "5"]


def method_counters(row: dict) -> dict:
    return {key: row[key] for key in COUNTERS if key != CLIENT_SECONDS}


@pytest.mark.slow
def test_a_ctpfl_run_with_both_diagnostics_trains_the_same_model(tmp_path, reductions):
    main(["fit", *CTPFL_RUN, "--config", callbacks_config(tmp_path, *DIAGNOSTICS), "--out_dir", str(tmp_path / "with")])
    main(["fit", *CTPFL_RUN, "--out_dir", str(tmp_path / "without")])

    measured, plain = final_checkpoint(tmp_path / "with"), final_checkpoint(tmp_path / "without")
    for name, tensor in plain["model"].items():
        assert torch.equal(measured["model"][name], tensor), name
    direction = plain["algorithm"]["server_state"]["direction"]
    assert torch.equal(measured["algorithm"]["server_state"]["direction"], direction)
    assert torch.equal(measured["rng"], plain["rng"])
    rows, plain_rows = read_metrics(tmp_path / "with"), read_metrics(tmp_path / "without")
    assert [row["train_loss"] for row in rows] == [row["train_loss"] for row in plain_rows]
    # The diagnostics' passes are counted apart, never as the method's.
    assert [method_counters(row) for row in rows] == [method_counters(row) for row in plain_rows]
    assert rows[-1][DIAG_GRAD_EVALS] > 0 and DIAG_GRAD_EVALS not in plain_rows[-1]
    assert [row["round"] for row in rows if "ctpfl/bias" in row] == [2, 4, 5]
    assert [row["round"] for row in rows if "hessian/trace" in row] == [3, 5]
    # One reduction per diagnostic on each of its rounds: g(x^r) and the clients' bias (d + 1
    # values), the landscape's 7 values, each with the round's two pass counts.
    num_params = direction.numel()
    assert sorted(reductions) == sorted([num_params + 1 + 2] * 3 + [7 + 2] * 2)
    for row in rows:
        if "ctpfl/bias" in row:
            assert 0 < row["ctpfl/bias"] and -1 <= row["ctpfl/cosine"] <= 1
            assert row["ctpfl/bias"] <= row["ctpfl/client_bias"] + 1e-6  # |sum p_i b_i| <= sum p_i |b_i|


@pytest.mark.multiprocess
def test_on_two_ranks_the_diagnostics_agree_with_one_and_leave_training_alone(tmp_path):
    config = callbacks_config(tmp_path, *DIAGNOSTICS)
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment = {k: v for k, v in environment.items() if not k.startswith("SLURM_")}

    def two_ranks(out_dir: Path, *extra: str) -> None:
        completed = processes.run_ranks(
            [sys.executable, "-m", "fl_lightning", "fit", *CTPFL_RUN, *extra, "--fabric.devices", "2",
             "--fabric.process_group_timeout_s", "120", "--out_dir", str(out_dir)], env=environment, ranks=2,
            timeout=600)
        assert [rank.returncode for rank in completed] == [0, 0], [rank.stderr for rank in completed]

    two_ranks(tmp_path / "two", "--config", config)
    two_ranks(tmp_path / "two_plain")
    main(["fit", *CTPFL_RUN, "--config", config, "--out_dir", str(tmp_path / "one")])

    measured, plain = final_checkpoint(tmp_path / "two"), final_checkpoint(tmp_path / "two_plain")
    for name, tensor in plain["model"].items():
        assert torch.equal(measured["model"][name], tensor), name
    two, one = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    for row_two, row_one in zip(two, one):
        assert [row_two[key] for key in DIAG_COUNTERS] == [row_one[key] for key in DIAG_COUNTERS]
        for name in sorted(set(row_one) & (CTPFL_METRICS | {"ctpfl/bias_curvature", "hessian/lambda_max",
                                                            "hessian/lambda_min", "hessian/trace"})):
            if not name.endswith("seconds"):
                assert row_two[name] == pytest.approx(row_one[name], rel=1e-3, abs=1e-5), (row_one["round"], name)


def test_the_cost_benchmark_runs_and_its_two_federations_end_alike(capsys):
    spec = importlib.util.spec_from_file_location("diagnostics_benchmark",
                                                  REPOSITORY / "benchmarks" / "diagnostics.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    medians = benchmark.main(["--model", "linear", "--clients", "2", "--local-steps", "2", "--batch-size", "8",
                              "--repeats", "1", "--subset-size", "16", "--iterations", "3", "--probes", "2"])
    printed = capsys.readouterr().out
    for row in (benchmark.PLAIN, benchmark.UNMEASURED, benchmark.MEASURED, benchmark.BIAS, benchmark.LANDSCAPE):
        assert medians[row] > 0 and row in printed
    assert medians["same_model"] == 1.0
    assert "bitwise equal: True" in printed
