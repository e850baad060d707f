"""FedCONST's CONST constraint: the invariants it promises, alone and composed with algorithms."""

import pytest
import torch
from reference import small_setup

from fl_lightning.algorithms import FedAvg
from fl_lightning.algorithms.moon import MOON
from fl_lightning.algorithms.scaffold import SCAFFOLD
from fl_lightning.clients import LocalSGD
from fl_lightning.config import ClientOptimizerArgs, ModelArgs
from fl_lightning.constraints import CONST
from fl_lightning.errors import ConfigError
from fl_lightning.fit import fit
from fl_lightning.flat import FlatLayout
from fl_lightning.models import create_model

TOLERANCE = 1e-5  # relative to |G_c|^2, fp32


def constrained_rows(params, layout, granularity="channel"):
    """Each constrained row as a vector: per output channel, per weight tensor, or all weights."""
    tensors = [t for t in layout.views(params).values() if t.ndim >= 2]
    if granularity == "channel":
        return [row for t in tensors for row in t.reshape(t.shape[0], -1)]
    if granularity == "layer":
        return [t.reshape(-1) for t in tensors]
    return [torch.cat([t.reshape(-1) for t in tensors])]


def violations(local, global_, layout, granularity="channel"):
    """Largest |1^T w_c| and |G_c^T (w_c - G_c)| over rows, each relative to |G_c|^2."""
    centring, orthogonality = 0.0, 0.0
    for w, g in zip(constrained_rows(local.double(), layout, granularity),
                    constrained_rows(global_.double(), layout, granularity)):
        scale = g.dot(g).item()
        centring = max(centring, abs(w.sum().item()) / scale)
        orthogonality = max(orthogonality, abs(g.dot(w - g).item()) / scale)
    return centring, orthogonality


def lenet():
    torch.manual_seed(0)
    return create_model("lenet5", num_classes=10, in_channels=3, image_size=32, norm="none", bias=False)


def flat_model(network):
    named = list(network.named_parameters())
    layout = FlatLayout.of(named)
    return layout.flatten(dict(named)), layout


def run_local_sgd(global_params, project, nesterov, steps=150):
    """Many momentum steps with weight decay on noisy directions plus a fixed correction (such as
    SCAFFOLD's c - c_i), all with large components along 1 and G."""
    generator = torch.Generator().manual_seed(1)
    correction = 1e-3 * torch.randn(global_params.shape, generator=generator) + 1e-3
    optimizer = LocalSGD(ClientOptimizerArgs(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=nesterov), project)
    params = global_params.clone()
    for _ in range(steps):
        gradient = 0.01 * torch.randn(params.shape, generator=generator) + 0.02 * params
        params = optimizer.step(params, gradient + correction)
    return params


@pytest.mark.slow
@pytest.mark.parametrize("granularity, nesterov", [("channel", False), ("channel", True), ("layer", False),
                                                   ("model", True)])
def test_local_sgd_keeps_both_constraints(granularity, nesterov):
    network = lenet()
    constraint = CONST(granularity=granularity)
    constraint.prepare_model(network)
    global_params, layout = flat_model(network)
    local = run_local_sgd(global_params, constraint.projection(global_params, layout), nesterov)
    assert (local - global_params).norm() > 0.1 * global_params.norm()  # the model did move
    centring, orthogonality = violations(local, global_params, layout, granularity)
    assert centring < TOLERANCE and orthogonality < TOLERANCE


def test_without_the_projection_the_same_quantities_are_large():
    network = lenet()
    CONST().prepare_model(network)
    global_params, layout = flat_model(network)
    local = run_local_sgd(global_params, None, nesterov=False)
    centring, orthogonality = violations(local, global_params, layout)
    assert centring > 1e-2 and orthogonality > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("centralize, orthogonal", [(True, False), (False, True)])
def test_each_constraint_alone_keeps_only_its_own_invariant(centralize, orthogonal):
    network = lenet()
    constraint = CONST(centralize=centralize, orthogonal=orthogonal)
    constraint.prepare_model(network)
    global_params, layout = flat_model(network)
    local = run_local_sgd(global_params, constraint.projection(global_params, layout), nesterov=False)
    centring, orthogonality = violations(local, global_params, layout)
    assert (centring < TOLERANCE) == centralize
    assert (orthogonality < TOLERANCE) == orthogonal


def test_prepare_model_centres_each_constrained_row_once():
    network = lenet()
    before, layout = flat_model(network)
    CONST().prepare_model(network)
    after, _ = flat_model(network)
    for row_before, row_after in zip(constrained_rows(before, layout), constrained_rows(after, layout)):
        torch.testing.assert_close(row_after, row_before - row_before.mean())
    untouched = lenet()
    CONST(centralize=False).prepare_model(untouched)
    assert torch.equal(flat_model(untouched)[0], before)


def test_skipped_layers_are_neither_centred_nor_projected():
    network = lenet()
    before, layout = flat_model(network)
    constraint = CONST(skip_first_layer=True, skip_classifier=True)
    constraint.prepare_model(network)
    global_params, _ = flat_model(network)
    views = dict(zip(layout.names, zip(layout.views(before).values(), layout.views(global_params).values())))
    for name in ("conv1.weight", "classifier.weight"):
        assert torch.equal(*views[name])
    assert not torch.equal(*views["conv2.weight"])

    direction = torch.randn(global_params.shape)
    projected = layout.views(constraint.projection(global_params, layout)(direction))
    original = layout.views(direction)
    assert torch.equal(projected["conv1.weight"], original["conv1.weight"])
    assert torch.equal(projected["classifier.weight"], original["classifier.weight"])
    assert projected["fc1.weight"].sum(dim=1).abs().max() < 1e-5


def test_projection_leaves_one_dimensional_parameters_alone():
    network = create_model("resnet18", num_classes=10, in_channels=3, image_size=32, norm="gn", bias=False)
    constraint = CONST()
    constraint.prepare_model(network)
    global_params, layout = flat_model(network)
    direction = torch.randn(global_params.shape)
    projected = constraint.projection(global_params, layout)(direction)
    for name, before, after in zip(layout.names, layout.views(direction).values(), layout.views(projected).values()):
        if before.ndim == 1:  # GroupNorm affine parameters
            assert torch.equal(before, after), name
        else:
            assert not torch.equal(before, after), name


# End to end: with one client per round and server lr 1, the new global model is that client's
# local model y, so fit(rounds=R) is y of round R and fit(rounds=R-1) the G it was trained from.

def constrained_setup(root, out_dir, rounds):
    setup = small_setup(root, out_dir, rounds=rounds, clients_per_round=1, local_epochs=2, batch_size=10,
                        eval_every=rounds)
    setup["model"] = ModelArgs(name="lenet5", norm="none", bias=False)
    setup["client_optimizer"] = ClientOptimizerArgs(lr=0.05, momentum=0.9, weight_decay=1e-3)
    return setup


def global_and_local_model(make, constraint, root, out_dir, rounds=3):
    """The global model G of the last round and the local model y trained from it."""
    global_model, local_model = (
        fit(algorithm=make(), constraint=constraint, **constrained_setup(root, out_dir / str(r), r))
        for r in (rounds - 1, rounds)
    )
    network = make().prepare_model(create_model("lenet5", num_classes=10, in_channels=3, image_size=32, bias=False))
    return global_model, local_model, flat_model(network)[1]


@pytest.mark.slow
@pytest.mark.parametrize("make", [FedAvg, SCAFFOLD, lambda: MOON(projection_dim=32)],
                         ids=["fedavg", "scaffold", "moon"])
def test_local_models_keep_the_constraints_in_federated_training(cifar_root, tmp_path, make):
    global_model, local_model, layout = global_and_local_model(make, CONST(), cifar_root, tmp_path)
    assert (local_model - global_model).norm() > 0.1 * global_model.norm()
    centring, orthogonality = violations(local_model, global_model, layout)
    assert centring < TOLERANCE and orthogonality < TOLERANCE
    # The global model received after several rounds of averaging is still centred.
    assert violations(global_model, global_model, layout)[0] < TOLERANCE


@pytest.mark.slow
def test_without_the_constraint_federated_training_breaks_both_invariants(cifar_root, tmp_path):
    global_model, local_model, layout = global_and_local_model(FedAvg, None, cifar_root, tmp_path)
    centring, orthogonality = violations(local_model, global_model, layout)
    assert centring > 1e-3 and orthogonality > 1e-3


@pytest.mark.parametrize("model, field", [
    (ModelArgs(name="resnet18", norm="bn", bias=False), "model.norm"),
    (ModelArgs(name="lenet5", bias=True), "model.bias"),
])
def test_unsuitable_models_are_config_errors_before_training(cifar_root, tmp_path, model, field):
    setup = small_setup(cifar_root, tmp_path)
    setup["model"] = model
    with pytest.raises(ConfigError) as error:
        fit(algorithm=FedAvg(), constraint=CONST(), **setup)
    assert error.value.field_name == field
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()


def test_bad_granularity_is_a_config_error():
    with pytest.raises(ConfigError) as error:
        CONST(granularity="row")
    assert error.value.field_name == "constraint.init_args.granularity"
