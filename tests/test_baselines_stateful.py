"""SCAFFOLD, FedDyn and MOON against direct reference computations (several rounds, partial
participation), and their per-client state across ranks and resumes."""

import processes
import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.fabric import Fabric
from reference import SEED, LinearProblem, assert_close, small_setup
from torch import nn

from fl_lightning.algorithms.base import PSEUDO_GRADIENT
from fl_lightning.algorithms.feddyn import FedDyn
from fl_lightning.algorithms.moon import MOON
from fl_lightning.algorithms.scaffold import SCAFFOLD
from fl_lightning.checkpoint import load_checkpoint
from fl_lightning.clients.run import CLIENT_STREAM, batch_positions, seeded_generator
from fl_lightning.config import ClientOptimizerArgs, FabricArgs, FederationArgs, ModelArgs
from fl_lightning.errors import ConfigError
from fl_lightning.federation.aggregation import sample_clients
from fl_lightning.federation.global_state import FlatGlobalModel
from fl_lightning.federation.setup import RunSettings
from fl_lightning.federation.trainer import LocalTrainer, TrainingData
from fl_lightning.fit import fit
from fl_lightning.models import FeatureClassifier, create_model
from fl_lightning.module import ClassificationModule
from fl_lightning.server_optimizers import ServerSGD


def sampled(round_index, setup):
    federation = setup["federation"]
    return sample_clients(SEED, round_index, federation.num_clients, federation.clients_per_round)


def last_checkpoint(out_dir):
    return load_checkpoint(out_dir / "checkpoints" / "last.ckpt")


def returning(setup):
    """Clients that train in more than one round."""
    rounds = [set(sampled(r, setup)) for r in range(setup["federation"].rounds)]
    return {c for a in range(len(rounds)) for b in range(a + 1, len(rounds)) for c in rounds[a] & rounds[b]}


def returning_after_a_gap(setup):
    """Clients that train, sit at least one round out, then train again."""
    rounds = [set(sampled(r, setup)) for r in range(setup["federation"].rounds)]
    return {
        c for c in range(setup["federation"].num_clients)
        if any(c in rounds[a] and c not in rounds[b] and c in rounds[d]
               for a in range(len(rounds)) for b in range(a + 1, len(rounds)) for d in range(b + 1, len(rounds)))
    }


def client_batches(problem, setup, round_index, client):
    """The client's mini-batches (as training-sample indices), drawn as every client draws them."""
    federation = setup["federation"]
    generator = seeded_generator(SEED, CLIENT_STREAM, round_index, client)
    positions = batch_positions(problem.num_samples(client), federation.batch_size, federation.local_steps,
                                federation.local_epochs, generator)
    return [problem.client_samples[client][p] for p in positions]


def distance_along_constant_direction(num_steps, lr, momentum, nesterov):
    """How far the local optimizer's recurrence moves in num_steps along a direction of 1."""
    position, buffer = 0.0, None
    for _ in range(num_steps):
        buffer = 1.0 if buffer is None else momentum * buffer + 1.0
        position += lr * ((1.0 + momentum * buffer if nesterov else buffer) if momentum else 1.0)
    return position


@pytest.mark.slow
@pytest.mark.parametrize("momentum, nesterov, effective_steps", [
    (0.0, False, False), (0.9, False, False), (0.9, False, True), (0.5, True, True)])
def test_scaffold_matches_reference_with_controls_kept_across_skipped_rounds(
        cifar_root, tmp_path, momentum, nesterov, effective_steps):
    # Mini-batches of 20 give clients of different sizes different step counts K_i.
    setup = small_setup(cifar_root, tmp_path, rounds=5, local_epochs=1, batch_size=20, eval_every=5)
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
            mean_change += (y - x) / len(clients)  # uniform weights, the paper's default
            control_change += new_control - control
            client_controls[c] = new_control
            step_counts.add(len(batches))
        x = x + gamma * mean_change
        server_control = server_control + control_change / num_clients
    assert len(step_counts) > 1
    assert returning_after_a_gap(setup)
    assert_close(final, x)

    checkpoint = last_checkpoint(tmp_path)
    assert_close(checkpoint["algorithm"]["server_state"]["control"], server_control)
    assert set(checkpoint["client_states"]) == set(client_controls)
    for c, control in client_controls.items():
        assert_close(checkpoint["client_states"][c]["control"], control)


@pytest.mark.parametrize("alpha", [0.01, 0.3])
def test_feddyn_matches_reference(cifar_root, tmp_path, alpha):
    setup = small_setup(cifar_root, tmp_path, rounds=4)
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
        h = h - alpha / num_clients * sum(y - x for y in local_models)
        x = sum(local_models) / len(local_models) - h / alpha
    assert returning_after_a_gap(setup)
    assert_close(final, x)

    checkpoint = last_checkpoint(tmp_path)
    assert_close(checkpoint["algorithm"]["server_state"]["h"], h)
    for c, h_c in client_h.items():
        assert_close(checkpoint["client_states"][c]["h_k"], h_c)


HIDDEN, PROJECTION = 16, 32


def moon_setup(root, out_dir, **federation):
    setup = small_setup(root, out_dir, **federation)
    setup["model"] = ModelArgs(name="mlp", options={"hidden": HIDDEN, "depth": 1})
    return setup


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
def test_moon_matches_reference(cifar_root, tmp_path):
    mu, tau, lr = 5.0, 0.5, 0.05
    setup = moon_setup(cifar_root, tmp_path, rounds=4)
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
            previous_models[c] = y
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
    client = trainer.client_round(0, 1, {"previous_model": previous_params.clone(),
                                       "previous_buffers": previous_buffers.clone()})
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


STATEFUL = {
    "scaffold": (SCAFFOLD, "linear"),
    "feddyn": (lambda: FedDyn(alpha=0.1), "linear"),
    "moon": (lambda: MOON(projection_dim=PROJECTION), "mlp"),
}


def stateful_setup(name, root, out_dir, **federation):
    setup = moon_setup(root, out_dir, **federation) if STATEFUL[name][1] == "mlp" else small_setup(
        root, out_dir, **federation)
    setup["client_optimizer"] = ClientOptimizerArgs(lr=0.05, momentum=0.5)
    return setup


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", STATEFUL)
def test_two_ranks_give_the_same_model_as_one(cifar_root, tmp_path, name):
    make = STATEFUL[name][0]
    setup = stateful_setup(name, cifar_root, tmp_path / "one", rounds=3)
    assert returning(setup)
    single = fit(algorithm=make(), **setup)
    setup.update(out_dir=tmp_path / "two", fabric=FabricArgs(accelerator="cpu", devices=2, process_group_timeout_s=120))
    double = processes.call_on_ranks(2, fit, algorithm=make(), **setup)
    torch.testing.assert_close(double, single, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", STATEFUL)
def test_resume_from_mid_run_checkpoint_reproduces_the_uninterrupted_run(cifar_root, tmp_path, name):
    make = STATEFUL[name][0]

    def run(out_dir, rounds, resume):
        setup = stateful_setup(name, cifar_root, out_dir, rounds=rounds, eval_every=1)
        setup["resume"] = resume
        return fit(algorithm=make(), **setup)

    setup = stateful_setup(name, cifar_root, tmp_path, rounds=4)
    assert set(sampled(0, setup) + sampled(1, setup)) & set(sampled(2, setup) + sampled(3, setup))  # state is read back
    uninterrupted = run(tmp_path / "a", 4, None)
    run(tmp_path / "b", 2, None)
    resumed = run(tmp_path / "b", 4, "auto")
    torch.testing.assert_close(resumed, uninterrupted, rtol=0, atol=0)


@pytest.mark.parametrize("make, field", [
    (lambda: FedDyn(alpha=0.0), "algorithm.init_args.alpha"),
    (lambda: FedDyn(alpha=-0.01), "algorithm.init_args.alpha"),
    (lambda: MOON(mu=-1.0), "algorithm.init_args.mu"),
    (lambda: MOON(tau=0.0), "algorithm.init_args.tau"),
    (lambda: MOON(tau=-0.5), "algorithm.init_args.tau"),
    (lambda: MOON(projection_dim=0), "algorithm.init_args.projection_dim"),
])
def test_bad_hyperparameters_are_config_errors(make, field):
    with pytest.raises(ConfigError) as error:
        make()
    assert error.value.field_name == field


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
