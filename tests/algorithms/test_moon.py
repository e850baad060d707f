"""MOON against a direct reference computation (the model-contrastive term on the projection head, the global and
previous models frozen in eval mode), its head, and its options in the written config."""

import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.fabric import Fabric
from reference import (
    HIDDEN,
    PROJECTION,
    SEED,
    LinearProblem,
    assert_close,
    last_checkpoint,
    moon_setup,
    participation_pattern,
    returning,
    returning_after_a_gap,
    sampled,
)
from torch import nn

from fl_lightning.algorithms.base import PSEUDO_GRADIENT
from fl_lightning.algorithms.moon import MOON
from fl_lightning.config import ClientOptimizerArgs, FederationArgs
from fl_lightning.federation.global_state import FlatGlobalModel
from fl_lightning.federation.setup import RunSettings
from fl_lightning.federation.trainer import LocalTrainer, TrainingData
from fl_lightning.fit import fit
from fl_lightning.models import FeatureClassifier, create_model
from fl_lightning.module import ClassificationModule
from fl_lightning.server_optimizers import ServerSGD


def moon_initial_params(num_classes):
    torch.manual_seed(SEED)
    network = MOON(projection_dim=PROJECTION).prepare_model(
        create_model("mlp", num_classes=num_classes, in_channels=3, image_size=32, hidden=HIDDEN, depth=1))
    shapes = [tuple(p.shape) for p in network.parameters()]
    # encoder layer, head Linear(16, 16) - ReLU - Linear(16, 32), classifier on the projection
    assert shapes == [(HIDDEN, 3072), (HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,), (PROJECTION, HIDDEN), (PROJECTION,),
                      (num_classes, PROJECTION), (num_classes,)]
    return torch.cat([p.detach().reshape(-1) for p in network.parameters()]).double(), shapes


class MoonProblem:
    """The MLP with MOON's head, written out, on each client's full batch."""

    def __init__(self, problem, shapes):
        self.problem = problem
        self.shapes = shapes

    def unpack(self, params):
        return [chunk.view(shape) for chunk, shape in zip(params.split([torch.Size(s).numel() for s in self.shapes]),
                                                          self.shapes)]

    def projection(self, params, client):
        w1, b1, a1, c1, a2, c2, _, _ = self.unpack(params)
        inputs = self.problem.inputs[self.problem.client_samples[client]]
        hidden = torch.relu(inputs @ w1.T + b1)
        return torch.relu(hidden @ a1.T + c1) @ a2.T + c2

    def cross_entropy(self, params, client):
        *_, classifier_weight, classifier_bias = self.unpack(params)
        logits = self.projection(params, client) @ classifier_weight.T + classifier_bias
        return F.cross_entropy(logits, self.problem.labels[self.problem.client_samples[client]])

    def contrastive(self, params, global_params, previous_params, client, tau):
        # z_glob and z_prev are frozen models' (eval mode: the same as train mode for this MLP).
        z = self.projection(params, client)
        z_global = self.projection(global_params, client).detach()
        z_previous = self.projection(previous_params, client).detach()

        def cosine(a, b):
            return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))

        logits = torch.stack([cosine(z, z_global), cosine(z, z_previous)], 1) / tau
        return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long))


@pytest.mark.slow
@pytest.mark.parametrize("participation", ["uniform", "cyclic_with_dropouts", "long_absences"])
def test_moon_matches_reference(cifar_root, tmp_path, participation):
    mu, tau, lr = 5.0, 0.5, 0.05
    rounds = 4 if participation == "uniform" else 6
    setup = moon_setup(cifar_root, tmp_path, rounds=rounds, eval_every=rounds,
                       **participation_pattern(participation, tmp_path))
    final = fit(algorithm=MOON(mu=mu, tau=tau, projection_dim=PROJECTION),
                client_optimizer=ClientOptimizerArgs(lr=lr), **setup)

    problem = LinearProblem(cifar_root, tmp_path)
    x, shapes = moon_initial_params(problem.num_classes)
    moon = MoonProblem(problem, shapes)
    previous_models = {}
    for r in range(setup["federation"].rounds):
        clients = sampled(r, setup)
        total = sum(problem.num_samples(c) for c in clients)
        update = torch.zeros_like(x)
        for c in clients:
            y = x.clone()
            for _ in range(setup["federation"].local_epochs):
                y.requires_grad_(True)
                # On a client's first round the global model stands in for the previous one: both
                # logits are equal and the term's gradient vanishes, so the product leaves it out.
                loss = moon.cross_entropy(y, c) + mu * moon.contrastive(y, x, previous_models.get(c, x), c, tau)
                (gradient,) = torch.autograd.grad(loss, y)
                y = y.detach() - lr * gradient
            previous_models[c] = y  # a dropped client's stays as it was: it never reported
            update += problem.num_samples(c) / total * (y - x)
        x = x + update
    assert returning_after_a_gap(setup)
    assert_close(final, x)
    checkpoint = last_checkpoint(tmp_path)
    for c, previous in previous_models.items():
        assert_close(checkpoint["client_states"][c]["previous_model"], previous)


@pytest.mark.slow
def test_moon_contrastive_term_is_zero_on_a_clients_first_round_only(cifar_root, tmp_path):
    def run(mu, rounds):
        setup = moon_setup(cifar_root, tmp_path / f"mu{mu}_rounds{rounds}", rounds=rounds, eval_every=rounds)
        return fit(algorithm=MOON(mu=mu, projection_dim=PROJECTION), client_optimizer=ClientOptimizerArgs(lr=0.05),
                   **setup)

    # Round 1: every client is new, so mu changes nothing.
    torch.testing.assert_close(run(5.0, 1), run(0.0, 1), rtol=0, atol=0)
    # Round 2 brings back clients of round 1 (with this seed), and the term acts on them.
    assert returning(moon_setup(cifar_root, tmp_path, rounds=2))
    assert (run(5.0, 2) - run(0.0, 2)).abs().max() > 1e-4


class NormalisedEncoder(FeatureClassifier):
    """Linear -> BatchNorm -> ReLU on flat inputs: a representation that differs between train mode
    (batch statistics) and eval mode (running statistics)."""

    def __init__(self, in_features, width, num_classes):
        super().__init__()
        self.linear = nn.Linear(in_features, width)
        self.norm = nn.BatchNorm1d(width)
        self.feature_dim = width
        self.classifier = nn.Linear(width, num_classes)

    def forward_features(self, x):
        return torch.relu(self.norm(self.linear(x)))


class UnchangedFeatures:
    """The transform of data that needs none (feature vectors rather than images)."""

    augment = False

    def __call__(self, images, generator=None, crops=None):
        return images


def test_moon_represents_the_global_and_previous_models_in_eval_mode():
    """z_glob and z_prev use the running statistics of the global and of the previous model; the
    local model normalises with its batch statistics and updates its own running statistics."""
    num_samples, in_features, width, num_classes, projection = 24, 6, 5, 3, 4
    mu, tau, lr, epochs = 5.0, 0.5, 0.1, 3
    torch.manual_seed(SEED)
    algorithm = MOON(mu=mu, tau=tau, projection_dim=projection)
    module = ClassificationModule(algorithm.prepare_model(NormalisedEncoder(in_features, width, num_classes)),
                                  num_classes)
    model = FlatGlobalModel.bind(module, torch.device("cpu"))
    shapes = [tuple(p.shape) for p in module.parameters()]
    assert shapes == [(width, in_features), (width,), (width,), (width,), (width, width), (width,),
                      (projection, width), (projection,), (num_classes, projection), (num_classes,)]
    assert model.buffers.numel() == 2 * width  # running mean and variance
    # Running statistics far from those of any batch, as after rounds of training elsewhere.
    model.buffers.copy_(torch.cat([torch.randn(width), torch.rand(width) + 0.5]))
    previous_params = model.params + 0.3 * torch.randn_like(model.params)
    previous_buffers = torch.cat([torch.randn(width), torch.rand(width) + 0.5])
    inputs, labels = torch.randn(num_samples, in_features), torch.randint(num_classes, (num_samples,))

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    federation = FederationArgs(num_clients=1, clients_per_round=1, local_epochs=epochs, batch_size=num_samples)
    settings = RunSettings(algorithm, federation=federation, client_optimizer=ClientOptimizerArgs(lr=lr), seed=SEED)
    trainer = LocalTrainer(fabric, module, TrainingData(inputs, labels, UnchangedFeatures()), model,
                           [torch.arange(num_samples)], settings)
    server = algorithm.setup(ServerSGD(), model.params.numel(), 1, model.params.device)
    client = trainer.client_round(0, 1, {"previous_model": previous_params.clone(),
                                       "previous_buffers": previous_buffers.clone()}, server)
    local = model.params - algorithm.client_update(client)[PSEUDO_GRADIENT]

    def unpack(params):
        return params.split([torch.Size(s).numel() for s in shapes])

    def projected(params, running, training):
        weight, bias, gamma, beta, a1, c1, a2, c2, _, _ = [c.view(s) for c, s in zip(unpack(params), shapes)]
        hidden = inputs.double() @ weight.T + bias
        mean, var = (hidden.mean(0), hidden.var(0, unbiased=False)) if training else running.split(width)
        hidden = torch.relu((hidden - mean) / torch.sqrt(var + 1e-5) * gamma + beta)
        return torch.relu(hidden @ a1.T + c1) @ a2.T + c2

    def reference(frozen_in_eval_mode):
        x, y, running = model.params.double(), model.params.double(), model.buffers.double()
        z_global = projected(x, running, not frozen_in_eval_mode)
        z_previous = projected(previous_params.double(), previous_buffers.double(), not frozen_in_eval_mode)
        for _ in range(epochs):
            y.requires_grad_(True)
            z = projected(y, None, True)
            *_, classifier_weight, classifier_bias = unpack(y)
            logits = z @ classifier_weight.view(num_classes, projection).T + classifier_bias
            contrastive = torch.stack([F.cosine_similarity(z, z_global), F.cosine_similarity(z, z_previous)], 1) / tau
            loss = F.cross_entropy(logits, labels) + mu * F.cross_entropy(contrastive, torch.zeros_like(labels))
            (gradient,) = torch.autograd.grad(loss, y)
            # BatchNorm's running statistics (momentum 0.1, unbiased batch variance) of the local model.
            weight, bias = unpack(y.detach())[:2]
            hidden = inputs.double() @ weight.view(width, in_features).T + bias
            running = 0.9 * running + 0.1 * torch.cat([hidden.mean(0), hidden.var(0)])
            y = y.detach() - lr * gradient
        return y, running

    expected, expected_buffers = reference(frozen_in_eval_mode=True)
    assert_close(local, expected)
    assert_close(client.state["previous_model"], expected)
    assert_close(client.state["previous_buffers"], expected_buffers)
    assert_close(client.buffers, expected_buffers)
    # Representing the frozen models in train mode (batch statistics) would give another model.
    assert (reference(frozen_in_eval_mode=False)[0] - expected).abs().max() > 1e-2


def test_moon_head_follows_the_networks_biases():
    network = create_model("lenet5", num_classes=10, in_channels=3, image_size=32, bias=False)
    moon_network = MOON().prepare_model(network)
    assert all(p.ndim >= 2 for p in moon_network.parameters())
    inputs = torch.randn(4, 3, 32, 32)
    assert moon_network.forward_features(inputs).shape == (4, 256)
    assert torch.equal(moon_network(inputs), moon_network.classifier(moon_network.forward_features(inputs)))


def test_moon_options_are_written_back_to_the_config(cifar_root, tmp_path):
    setup = moon_setup(cifar_root, tmp_path, rounds=1)
    fit(algorithm=MOON(mu=2.0, tau=0.3, projection_dim=PROJECTION), **setup)
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert config["algorithm"] == {"class_path": "fl_lightning.algorithms.moon.MOON",
                                   "init_args": {"mu": 2.0, "tau": 0.3, "projection_dim": PROJECTION}}
