"""FedCONST's CONST constraint: the invariants it promises, alone and composed with algorithms, and
each of its variants (the paper's reading, its authors' code's) against a direct reference."""

import processes
import pytest
import torch
from reference import LR, LinearProblem, sample_weights, sampled, small_setup

from fl_lightning.algorithms import FedAvg
from fl_lightning.algorithms.moon import MOON
from fl_lightning.algorithms.scaffold import SCAFFOLD
from fl_lightning.clients import LocalSGD
from fl_lightning.config import ClientOptimizerArgs, ComputeArgs, FabricArgs, ModelArgs
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


# --- the variants against a direct reference ---------------------------------------------------------
# Written from the description of each rule (the paper's equation 8, the authors' FedConst.py and
# their later variants), on plain tensors, one named tensor at a time.

AUTHORS_CODE = dict(granularity="model", constrained="displacement", when="after_step",
                    order="centre_then_orthogonalise", tensors="all")
LAYER_PER_LAYER = dict(AUTHORS_CODE, granularity="layer")
STRICT = dict(granularity="channel", constrained="displacement", when="after_step", order="strict_scale")
VARIANTS = {"paper": {}, "authors_code": AUTHORS_CODE, "layer_per_layer": LAYER_PER_LAYER, "strict": STRICT}


def paper_projection(direction, global_, shapes):
    """Each fan-in row d of a weight matrix minus its components along e1 = 1/sqrt(n) and
    e2 = u/|u|, u = G_c - mean(G_c); 1-D tensors as they are."""
    out = []
    for d, g in zip(direction.split([s.numel() for s in shapes]), global_.split([s.numel() for s in shapes])):
        shape = shapes[len(out)]
        if len(shape) < 2:
            out.append(d)
            continue
        rows = []
        for d_row, g_row in zip(d.reshape(shape[0], -1), g.reshape(shape[0], -1)):
            e1 = torch.full_like(d_row, 1 / d_row.numel() ** 0.5)
            u = g_row - g_row.mean()
            e2 = u / u.norm()
            rows.append(d_row - e1 * e1.dot(d_row) - e2 * e2.dot(d_row))
        out.append(torch.cat(rows))
    return torch.cat(out)


def code_rule(w, g):
    """FedConst.py's Constrainting on one flat vector: D = w - G, Dc = D - mean(D),
    w <- G + Dc - (<Dc, G> / |G|^2) G."""
    centred = (w - g) - (w - g).mean()
    return g + centred - centred.dot(g) / g.dot(g) * g


def strict_rule(w, g):
    """Constrainting_strict on one row: the scale is cos(Dc, G) |D| / |G|, |D| before centring."""
    displacement = w - g
    centred = displacement - displacement.mean()
    cosine = centred.dot(g) / (centred.norm() * g.norm())
    return g + centred - cosine * displacement.norm() / g.norm() * g


def after_step(variant, w, global_, shapes):
    sizes = [s.numel() for s in shapes]
    if variant == "authors_code":
        return code_rule(w, global_)
    out = []
    for w_t, g_t, shape in zip(w.split(sizes), global_.split(sizes), shapes):
        if variant == "layer_per_layer":
            out.append(code_rule(w_t, g_t))
        elif len(shape) < 2:
            out.append(w_t)
        else:
            out.append(torch.cat([strict_rule(a, b) for a, b in zip(w_t.reshape(shape[0], -1),
                                                                    g_t.reshape(shape[0], -1))]))
    return torch.cat(out)


def reference_steps(variant, global_, gradients, shapes, momentum, weight_decay=0.0):
    """Local SGD from `global_` along `gradients(w)` with the variant's rule, in float64."""
    w, buffer = global_.clone(), None
    for gradient in gradients:
        d = gradient(w) + weight_decay * w
        if variant == "paper":
            d = paper_projection(d, global_, shapes)
        buffer = d if buffer is None or not momentum else momentum * buffer + d
        w = w - 0.05 * buffer
        if variant != "paper":
            w = after_step(variant, w, global_, shapes)
    return w


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_steps_as_its_direct_reference(variant, momentum):
    torch.manual_seed(0)
    network = create_model("lenet5", num_classes=10, in_channels=3, image_size=32, norm="none",
                           bias=variant != "paper")
    constraint = CONST(**VARIANTS[variant])
    constraint.prepare_model(network)
    global_params, layout = flat_model(network)
    weight_decay = 1e-3 if variant == "paper" else 0.0
    generator = torch.Generator().manual_seed(1)
    # The offset moves the displacement's mean, where the orders and the strict scale differ.
    noise = [0.01 * torch.randn(global_params.shape, generator=generator, dtype=torch.float64) + 2e-3
             for _ in range(20)]
    gradients = [lambda w, n=n: n + 0.02 * w for n in noise]
    optimizer = LocalSGD(ClientOptimizerArgs(lr=0.05, momentum=momentum, weight_decay=weight_decay),
                         constraint.projection(global_params, layout), None,
                         constraint.step_projection(global_params, layout))
    params = global_params.clone()
    for gradient in gradients:
        params = optimizer.step(params, gradient(params.double()).float())
    expected = reference_steps(variant, global_params.double(), gradients, layout.shapes, momentum, weight_decay)
    assert (expected - global_params.double()).norm() > 0.05 * global_params.norm()  # the model did move
    torch.testing.assert_close(params.double(), expected, rtol=1e-5, atol=1e-6)


def reference_fit(problem, setup, variant, momentum):
    """The federation written out (full batches, server lr 1): each client's local SGD under the
    variant's rule from the round's global model, averaged by samples."""
    x = problem.initial_params()
    shapes = [torch.Size([problem.num_classes, problem.inputs.shape[1]]), torch.Size([problem.num_classes])]
    for r in range(setup["federation"].rounds):
        clients = sampled(r, setup)
        weights = sample_weights(problem, clients)
        steps = setup["federation"].local_epochs  # one full batch an epoch
        x = sum(weights[c] * reference_steps(variant, x, [lambda w, c=c: problem.grad(w, c)] * steps, shapes, momentum)
                for c in clients)
    return x


def fit_with_variant(root, out_dir, variant, momentum, client_path="loop", ranks=1):
    setup = small_setup(root, out_dir, rounds=3)
    arguments = dict(setup, algorithm=FedAvg(), constraint=CONST(**VARIANTS[variant]),
                     client_optimizer=ClientOptimizerArgs(lr=LR, momentum=momentum),
                     compute=ComputeArgs(client_path=client_path))
    if ranks == 1:
        return fit(**arguments), setup
    arguments["fabric"] = FabricArgs(accelerator="cpu", devices=ranks, process_group_timeout_s=120)
    return processes.call_on_ranks(ranks, fit, **arguments), setup


@pytest.mark.slow
@pytest.mark.parametrize("client_path", ["loop", "grouped"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("variant", ["authors_code", "layer_per_layer", "strict"])
def test_federated_training_with_each_code_variant_follows_the_reference(cifar_root, tmp_path, variant, momentum,
                                                                         client_path):
    final, setup = fit_with_variant(cifar_root, tmp_path, variant, momentum, client_path)
    expected = reference_fit(LinearProblem(cifar_root, tmp_path), setup, variant, momentum)
    torch.testing.assert_close(final.double(), expected, rtol=1e-4, atol=2e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["authors_code", "strict"])
def test_two_ranks_train_each_code_variant_as_the_reference(cifar_root, tmp_path, variant):
    final, setup = fit_with_variant(cifar_root, tmp_path, variant, 0.9, ranks=2)
    expected = reference_fit(LinearProblem(cifar_root, tmp_path), setup, variant, 0.9)
    torch.testing.assert_close(final.double(), expected, rtol=1e-4, atol=2e-5)


# --- what each variant keeps -----------------------------------------------------------------------


def displacement_violations(local, global_):
    """|<w - G, G>| / |G|^2 and |1^T (w - G)| / |G|^2 over the whole model."""
    local, global_ = local.double(), global_.double()
    scale = global_.dot(global_).item()
    return abs((local - global_).dot(global_).item()) / scale, abs((local - global_).sum().item()) / scale


@pytest.mark.slow
@pytest.mark.parametrize("centred", [True, False], ids=["centred G", "uncentred G"])
def test_the_codes_rule_keeps_orthogonality_and_zero_sum_only_from_a_zero_sum_global_model(centred):
    network = create_model("lenet5", num_classes=10, in_channels=3, image_size=32, norm="none", bias=True)
    global_params, layout = flat_model(network)
    if centred:
        global_params = global_params - global_params.mean()
    assert (abs(global_params.sum().item()) < 1e-3) == centred
    constraint = CONST(**AUTHORS_CODE)
    optimizer = LocalSGD(ClientOptimizerArgs(lr=0.05, momentum=0.9), None, None,
                         constraint.step_projection(global_params, layout))
    generator = torch.Generator().manual_seed(1)
    params = global_params.clone()
    for _ in range(150):
        params = optimizer.step(params, 0.01 * torch.randn(params.shape, generator=generator) + 0.02 * params + 1e-3)
    assert (params - global_params).norm() > 0.1 * global_params.norm()
    orthogonality, centring = displacement_violations(params, global_params)
    assert orthogonality < TOLERANCE
    assert (centring < TOLERANCE) == centred


@pytest.mark.slow
def test_the_codes_rule_keeps_orthogonality_over_rounds_of_federated_training(cifar_root, tmp_path):
    """The last round's global model G and the local model trained from it (one client a round)."""
    constraint = CONST(**AUTHORS_CODE)
    runs = []
    for rounds in (2, 3):
        setup = constrained_setup(cifar_root, tmp_path / str(rounds), rounds)
        setup["model"] = ModelArgs(name="lenet5", norm="none", bias=True)
        setup["client_optimizer"] = ClientOptimizerArgs(lr=0.05, momentum=0.9)
        runs.append(fit(algorithm=FedAvg(), constraint=constraint, **setup))
    global_model, local_model = runs
    assert (local_model - global_model).norm() > 0.05 * global_model.norm()
    orthogonality, centring = displacement_violations(local_model, global_model)
    assert orthogonality < TOLERANCE
    assert centring > 1e-4  # the model's sum is not zero, so the displacement's is not kept


def test_the_strict_scale_is_not_a_projection():
    """Its |D| / |Dc| >= 1 over-removes along G: neither orthogonal nor zero-sum after a step that
    moves the mean, unlike the code's FedConst.py order."""
    torch.manual_seed(0)
    network = create_model("lenet5", num_classes=10, in_channels=3, image_size=32, norm="none", bias=True)
    global_params, layout = flat_model(network)
    moved = global_params + 0.01 * torch.randn(global_params.shape) + 0.01
    strict = CONST(**STRICT).step_projection(global_params, layout)(moved)
    exact = CONST(**dict(STRICT, order="centre_then_orthogonalise")).step_projection(global_params, layout)(moved)
    for projected, orthogonal in ((strict, False), (exact, True)):
        rows = zip(constrained_rows(projected - global_params, layout), constrained_rows(global_params, layout))
        worst = max(abs(d.double().dot(g.double()).item()) / g.double().dot(g.double()).item() for d, g in rows)
        assert (worst < TOLERANCE) == orthogonal


@pytest.mark.parametrize("options, field", [
    (dict(order="strict_scale"), "order"),
    (dict(order="centre_then_orthogonalise", orthogonal=False), "order"),
    (dict(tensors="all", granularity="channel", constrained="displacement"), "tensors"),
    (dict(tensors="all", granularity="model"), "tensors"),
    (dict(AUTHORS_CODE, skip_classifier=True), "tensors"),
    (dict(granularity="row"), "granularity"),
    (dict(when="during"), "when"),
    (dict(constrained="gradients"), "constrained"),
])
def test_meaningless_combinations_are_config_errors(options, field):
    with pytest.raises(ConfigError) as error:
        CONST(**options)
    assert error.value.field_name == f"constraint.init_args.{field}"


def test_the_displacement_variants_take_models_with_biases_and_leave_them_uncentred():
    biased = create_model("lenet5", num_classes=10, in_channels=3, image_size=32, norm="none", bias=True)
    before = flat_model(biased)[0]
    CONST(**STRICT).prepare_model(biased)
    assert torch.equal(flat_model(biased)[0], before)
    with pytest.raises(ConfigError):
        CONST().prepare_model(biased)


def test_the_codes_variant_maps_norm_affine_parameters_and_no_running_statistics():
    """BatchNorm's running statistics are buffers: outside the parameters the map sees, left to
    training and averaged as always; its scale and shift are parameters, constrained with the rest."""
    network = create_model("resnet18", num_classes=10, in_channels=3, image_size=32, norm="bn", bias=False)
    constraint = CONST(**AUTHORS_CODE)
    constraint.prepare_model(network)  # CONST on the weights refuses BatchNorm; on the displacement not
    global_params, layout = flat_model(network)
    assert not any("running" in name for name in layout.names)
    moved = global_params + 1e-3
    change = layout.views(constraint.step_projection(global_params, layout)(moved) - moved)
    assert change["stem.1.weight"].abs().max() > 0 and change["stem.0.weight"].abs().max() > 0  # norm, conv
