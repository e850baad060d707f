"""The landscape diagnostic: Lanczos, power iteration and Hutchinson against exact spectra; the
diagnostic on a quadratic and on a tiny BatchNorm network against torch.autograd.functional.hessian
of the same loss; and in a real run, its metrics on its rounds only, one reduction each, and a
final model bitwise equal to the run without it."""

from functools import partial

import numpy as np
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
from torch import nn

from fl_lightning.algorithms import CTPFL, FedAvg
from fl_lightning.clients.run import seeded_generator
from fl_lightning.commands.main import main
from fl_lightning.diagnostics.landscape import (
    PROBE_STREAM,
    Landscape,
    hutchinson_trace,
    lanczos_extremes,
    power_extremes,
)
from fl_lightning.errors import ConfigError
from fl_lightning.federation.loop import FederatedLoop
from fl_lightning.run_logging import read_metrics

# Small problems driven through the real FederatedLoop (as federation.train drives it).


def exact_hessian(loop: FederatedLoop, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The Hessian of the eval-mode cross-entropy of the loop's model at its global parameters,
    from torch.autograd.functional.hessian over a functional call of the bare network."""
    network = loop.module.network
    layout, buffers = loop.global_model.param_layout, loop.global_model.buffer_layout.views(
        loop.global_model.buffers.clone())
    network.eval()

    def loss(flat: torch.Tensor) -> torch.Tensor:
        tensors = {name.removeprefix("network."): view for name, view in layout.views(flat).items()}
        tensors.update({name.removeprefix("network."): view for name, view in buffers.items()})
        logits = torch.func.functional_call(network, tensors, (inputs,))
        return nn.functional.cross_entropy(logits, labels)

    return torch.autograd.functional.hessian(loss, loop.global_model.params.detach().clone())


# The algorithms on exact spectra.

@pytest.mark.parametrize("eigenvalues", [[-3.0, -1.0, 0.5, 2.0, 7.0, 7.5], [4.0, 1.0, 0.1, 0.01]])
def test_lanczos_gives_the_extreme_eigenvalues_of_a_quadratic(eigenvalues):
    matrix = symmetric_matrix(eigenvalues).float()
    largest, smallest = lanczos_extremes(lambda v: matrix @ v, len(eigenvalues), 50, torch.Generator().manual_seed(0),
                                         torch.device("cpu"))
    assert largest == pytest.approx(max(eigenvalues), rel=1e-4, abs=1e-4)
    assert smallest == pytest.approx(min(eigenvalues), rel=1e-4, abs=1e-4)


def test_lanczos_with_fewer_steps_than_dimensions_finds_well_separated_extremes():
    eigenvalues = [-5.0] + list(np.linspace(0.0, 1.0, 198)) + [10.0]
    matrix = symmetric_matrix(eigenvalues, seed=1).float()
    largest, smallest = lanczos_extremes(lambda v: matrix @ v, 200, 30, torch.Generator().manual_seed(0),
                                         torch.device("cpu"))
    assert largest == pytest.approx(10.0, rel=1e-4)
    assert smallest == pytest.approx(-5.0, rel=1e-4)


@pytest.mark.parametrize("eigenvalues", [[-3.0, -1.0, 0.5, 2.0, 9.0], [-9.0, 0.5, 2.0, 3.0]])
def test_power_iteration_finds_both_ends_whichever_dominates(eigenvalues):
    matrix = symmetric_matrix(eigenvalues).float()
    largest, smallest = power_extremes(lambda v: matrix @ v, len(eigenvalues), 300, torch.Generator().manual_seed(0),
                                       torch.device("cpu"))
    assert largest == pytest.approx(max(eigenvalues), rel=1e-3)
    assert smallest == pytest.approx(min(eigenvalues), rel=1e-3)


def test_hutchinson_is_the_mean_of_its_probes_and_converges_to_the_trace():
    matrix = symmetric_matrix([-3.0, -1.0, 0.5, 2.0, 7.0, 1.5]).float()
    trace, stderr = hutchinson_trace(lambda v: matrix @ v, 6, 8, torch.Generator().manual_seed(3), torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    probes = [(torch.randint(0, 2, (6,), generator=generator) * 2 - 1).float() for _ in range(8)]
    direct = torch.tensor([z @ matrix @ z for z in probes], dtype=torch.float64)
    assert trace == pytest.approx(direct.mean().item(), rel=1e-6)
    assert stderr == pytest.approx(direct.std().item() / 8 ** 0.5, rel=1e-6)
    many, many_stderr = hutchinson_trace(lambda v: matrix @ v, 6, 20000, torch.Generator().manual_seed(4),
                                         torch.device("cpu"))
    assert abs(many - matrix.trace().item()) < 5 * many_stderr
    # A diagonal matrix has z^T D z = tr(D) for every Rademacher z.
    diagonal = torch.diag(torch.tensor([-2.0, 0.5, 4.0]))
    assert hutchinson_trace(lambda v: diagonal @ v, 3, 3, torch.Generator().manual_seed(0),
                            torch.device("cpu")) == (pytest.approx(2.5), 0.0)


# The diagnostic on a loop.

def test_landscape_of_a_quadratic_is_its_matrix():
    eigenvalues = [-2.0, -0.5, 0.25, 1.0, 3.0, 6.0]
    matrix = symmetric_matrix(eigenvalues)
    images = torch.randint(0, 256, (40, 1, 1, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    partition = [np.arange(0, 20), np.arange(20, 40)]
    landscape = Landscape(subset_size=16, batch_size=5, iterations=6, probes=4, seed=7)
    fabric, loop = federated_loop(Center(len(matrix)), images, torch.zeros(40, dtype=torch.long), partition,
                                  CTPFL(span=0.5), [landscape], module_type=partial(QuadraticModule, hessian=matrix))
    run_rounds(fabric, loop, 2)
    values = landscape.measure(loop)
    assert values["hessian/lambda_max"] == pytest.approx(6.0, rel=1e-4)
    assert values["hessian/lambda_min"] == pytest.approx(-2.0, rel=1e-4)
    assert values["hessian/convexity"] == pytest.approx(3.0, rel=1e-4)
    generator = seeded_generator(7, PROBE_STREAM)
    probes = [(torch.randint(0, 2, (6,), generator=generator) * 2 - 1).double() for _ in range(4)]
    assert values["hessian/trace"] == pytest.approx(np.mean([(z @ matrix @ z).item() for z in probes]), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("split, hvp, method, iterations", [
    ("train", "jvp", "lanczos", 60), ("test", "jvp", "lanczos", 60), ("test", "double_backward", "lanczos", 60),
    ("train", "double_backward", "power", 100)])
def test_landscape_of_a_tiny_batchnorm_network_matches_autograd_hessian(split, hvp, method, iterations):
    network, images, labels, partition, test = tiny_network_problem()
    landscape = Landscape(split=split, subset_size=20, batch_size=12, iterations=iterations, probes=5, hvp=hvp,
                          method=method, seed=3)
    fabric, loop = federated_loop(network, images, labels, partition, FedAvg(), [landscape], num_classes=3, test=test)
    inputs, subset_labels = landscape.subset(loop)
    assert len(subset_labels) == 20
    pool = loop.evaluation.test_transform(test[0] if split == "test" else images)
    assert (inputs[:, None] == pool[None]).flatten(2).all(2).any(1).all()  # drawn from the split asked for
    hessian = exact_hessian(loop, inputs, subset_labels)
    spectrum = torch.linalg.eigvalsh(hessian.double())
    assert spectrum[0] < 0 < spectrum[-1]  # an indefinite Hessian: both ends are tested
    values = landscape.measure(loop)
    tolerance = 1e-3 * spectrum.abs().max().item()
    assert values["hessian/lambda_max"] == pytest.approx(spectrum[-1].item(), abs=tolerance)
    assert values["hessian/lambda_min"] == pytest.approx(spectrum[0].item(), abs=tolerance)
    generator = seeded_generator(3, PROBE_STREAM)
    probes = [(torch.randint(0, 2, (hessian.shape[0],), generator=generator) * 2 - 1).float() for _ in range(5)]
    hutchinson = np.mean([(z @ hessian @ z).item() for z in probes])
    assert values["hessian/trace"] == pytest.approx(hutchinson, rel=1e-4, abs=1e-4)
    assert abs(values["hessian/trace"] - hessian.trace().item()) < 5 * values["hessian/trace_stderr"]
    expected_loss = nn.functional.cross_entropy(loop.module.network.eval()(inputs), subset_labels).item()
    assert values["hessian/loss"] == pytest.approx(expected_loss, rel=1e-5)


def test_landscape_leaves_the_model_its_buffers_and_the_global_random_stream_alone():
    network, images, labels, partition, _ = tiny_network_problem()
    landscape = Landscape(subset_size=20, iterations=5, probes=2)
    fabric, loop = federated_loop(network, images, labels, partition, FedAvg(), [landscape], num_classes=3)
    params, buffers = loop.global_model.params.clone(), loop.global_model.buffers.clone()
    rng = torch.get_rng_state()
    loop.module.train()
    landscape.measure(loop)
    assert torch.equal(loop.global_model.params, params) and torch.equal(loop.global_model.buffers, buffers)
    assert torch.equal(torch.get_rng_state(), rng)
    assert loop.module.training


@pytest.mark.parametrize("setting, value", [("subset_size", 0), ("iterations", 0), ("probes", 0), ("every", 0)])
def test_bad_settings_are_refused(setting, value):
    with pytest.raises(ConfigError, match=setting):
        Landscape(**{setting: value})


# In a run from the command line.


@pytest.mark.slow
def test_a_run_with_the_landscape_measured_trains_the_same_model(tmp_path, reductions):
    config = callbacks_config(tmp_path, {"class_path": "fl_lightning.diagnostics.landscape.Landscape",
                                         "init_args": {"every": 2, "subset_size": 100, "iterations": 10,
                                                       "probes": 3}})
    main(["fit", *TINY, "--federation.rounds", "5", "--config", config, "--out_dir", str(tmp_path / "with")])
    main(["fit", *TINY, "--federation.rounds", "5", "--out_dir", str(tmp_path / "without")])

    measured, plain = final_checkpoint(tmp_path / "with"), final_checkpoint(tmp_path / "without")
    for name, tensor in plain["model"].items():
        assert torch.equal(measured["model"][name], tensor), name
    assert torch.equal(measured["rng"], plain["rng"])
    rows = read_metrics(tmp_path / "with")
    assert [row["round"] for row in rows if "hessian/trace" in row] == [2, 4, 5]  # every 2 and the last
    assert len(reductions) == 3
    for row in rows:
        if "hessian/trace" in row:
            assert row["hessian/lambda_max"] >= row["hessian/lambda_min"]
            assert row["hessian/convexity"] == pytest.approx(abs(row["hessian/lambda_max"] / row["hessian/lambda_min"]))
    plain_rows = read_metrics(tmp_path / "without")
    assert [row["train_loss"] for row in rows] == [row["train_loss"] for row in plain_rows]
