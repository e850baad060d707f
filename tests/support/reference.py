"""Direct, slow reference computations for update-rule tests.

The problem: multinomial logistic regression (`model.name: linear`) on full client batches, so
every gradient is deterministic and the reference needs nothing of the product but its data
files, its partition file and its client-sampling draw.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from fl_lightning.checkpoint import load_checkpoint
from fl_lightning.clients.run import (
    CLIENT_STREAM,
    SPEED_STREAM,
    STEPS_STREAM,
    batch_positions,
    seeded_generator,
    seeded_numpy_generator,
)
from fl_lightning.config import ClientOptimizerArgs, DataArgs, FabricArgs, FederationArgs, LoggerArgs, ModelArgs
from fl_lightning.data import load_dataset
from fl_lightning.federation.aggregation import round_clients
from fl_lightning.fit import fit
from fl_lightning.models import create_model
from fl_lightning.participation import Cyclic, Trace
from fl_lightning.server_optimizers import ServerSGD

SEED = 3


def small_setup(root: Path, out_dir: Path, **federation) -> dict:
    """fit() keyword arguments for a tiny, full-batch, partially participating federation."""
    federation_args = dict(rounds=3, num_clients=5, clients_per_round=3, local_epochs=2, batch_size=1000,
                           eval_every=3)
    federation_args.update(federation)
    return dict(
        model=ModelArgs(name="linear"),
        data=DataArgs(name="cifar10", root=root, partition="dirichlet", alpha=1.0, min_samples=10, augment=False),
        federation=FederationArgs(**federation_args),
        # A short collective timeout: a rank left waiting by a failed peer ends the test quickly.
        fabric=FabricArgs(accelerator="cpu", devices=1, process_group_timeout_s=120),
        logger=LoggerArgs(progress_bar=False),
        seed=SEED,
        out_dir=out_dir,
        resume=None,
    )


class LinearProblem:
    """Each client's full-batch loss on the exact inputs the product's model sees."""

    def __init__(self, root: Path, out_dir: Path):
        train, _ = load_dataset("cifar10", root)
        mean = torch.tensor(train.mean).view(1, -1, 1, 1)
        std = torch.tensor(train.std).view(1, -1, 1, 1)
        self.inputs = ((train.images.double() / 255 - mean) / std).flatten(1)
        self.labels = train.labels
        self.num_classes = train.num_classes
        partition = json.loads((Path(out_dir) / "partition.json").read_text())
        self.client_samples = [torch.tensor(partition[str(i)]) for i in range(len(partition))]

    def initial_params(self) -> torch.Tensor:
        torch.manual_seed(SEED)
        model = create_model("linear", num_classes=self.num_classes, in_channels=3, image_size=32)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()

    def loss_on(self, params: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over `samples` (training-set indices)."""
        features = self.inputs.shape[1]
        weight = params[: self.num_classes * features].view(self.num_classes, features)
        bias = params[self.num_classes * features:]
        return F.cross_entropy(self.inputs[samples] @ weight.T + bias, self.labels[samples])

    def grad_on(self, params: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
        params = params.detach().clone().requires_grad_(True)
        (gradient,) = torch.autograd.grad(self.loss_on(params, samples), params)
        return gradient

    def loss(self, params: torch.Tensor, client: int) -> torch.Tensor:
        """The client's full-batch loss."""
        return self.loss_on(params, self.client_samples[client])

    def grad(self, params: torch.Tensor, client: int) -> torch.Tensor:
        return self.grad_on(params, self.client_samples[client])

    def num_samples(self, client: int) -> int:
        return len(self.client_samples[client])


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=2e-5)


# What the algorithms' reference computations share: the round's clients and their weights, local SGD,
# the mini-batches a client draws, which clients come back, and the setups of the stateful methods.


LR = 0.05
"""The clients' lr of the baselines' reference computations."""


def sampled(round_index, setup):
    """The clients of a round whose uploads reached the server, as every rank draws them (those online,
    drawn, and not dropped); the tests' federations are partially participating."""
    federation = setup["federation"]
    clients = round_clients(SEED, round_index, federation).reported
    assert len(clients) < federation.num_clients  # partial participation
    return clients


def participation_pattern(name, folder):
    """The federation settings of a participation pattern that the stateful methods are checked under, in
    small_setup's federation of 5 clients, 3 a round, over 6 rounds: every client online (uniform);
    2 cyclic groups with 40% of the uploads lost (round 6 loses every upload); a trace where
    client 2 reports in round 1, is away for three rounds and reports again in round 5, with lost
    uploads (clients 3's and 4's in round 3). Who reports is the product's draw, seeded by SEED."""
    if name == "uniform":
        return {}
    if name == "cyclic_with_dropouts":
        return dict(participation=Cyclic(groups=2), dropout=0.4)
    trace = Path(folder) / "online.txt"
    trace.write_text("0 1 2 3\n0 1 4\n0 3 4\n1 3 4\n0 1 2 3 4\n0 2 4\n")
    return dict(participation=Trace(path=str(trace)), dropout=0.3)


def sample_weights(problem, clients):
    """Each client's weight in the aggregate: its share of the round's samples."""
    total = sum(problem.num_samples(c) for c in clients)
    return {c: problem.num_samples(c) / total for c in clients}


def local_sgd(problem, x, client, steps, direction):
    """Plain SGD from x on the client's full batch: y <- y - LR * direction(y, gradient at y)."""
    y = x.clone()
    for _ in range(steps):
        y = y - LR * direction(y, problem.grad(y, client))
    return y


def mixed_direction_reference(problem, setup, gradient_weight, gamma, batches=None):
    """FedAvg-M / FedCM written out: steps along w g + (1 - w) G with G the previous round's
    sum_i p_i (x - y_i) / (LR K_i), uniform p. `batches(r, c)` gives each step's sample indices
    (None: one full batch per local epoch)."""
    x = problem.initial_params()
    global_direction = torch.zeros_like(x)
    for r in range(setup["federation"].rounds):
        clients = sampled(r, setup)
        update, next_direction = torch.zeros_like(x), torch.zeros_like(x)
        for c in clients:
            y = x.clone()
            steps = ([None] * setup["federation"].local_epochs) if batches is None else batches(r, c)
            for samples in steps:
                g = problem.grad(y, c) if samples is None else problem.grad_on(y, samples)
                y = y - LR * (gradient_weight * g + (1 - gradient_weight) * global_direction)
            update += (y - x) / len(clients)
            next_direction += (x - y) / (LR * len(steps)) / len(clients)
        x = x + gamma * update
        global_direction = next_direction
    return x


def last_checkpoint(out_dir):
    """The run's last checkpoint, loaded."""
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


def fit_with_mixed_direction(algorithm, gradient_weight, root, out_dir):
    """A FedAvg-M-like method (FedAvg-M, FedCM) trained 4 rounds, and its model as
    `mixed_direction_reference` computes it: (fit's, the reference's)."""
    setup = small_setup(root, out_dir, rounds=4)
    final = fit(algorithm=algorithm, client_optimizer=ClientOptimizerArgs(lr=LR), server_optimizer=ServerSGD(lr=0.9),
                **setup)
    return final, mixed_direction_reference(LinearProblem(root, out_dir), setup, gradient_weight, gamma=0.9)


def client_batches(problem, setup, round_index, client):
    """The client's mini-batches (as training-sample indices), drawn as every client draws them."""
    federation = setup["federation"]
    generator = seeded_generator(SEED, CLIENT_STREAM, round_index, client)
    positions = batch_positions(problem.num_samples(client), federation.batch_size, federation.local_steps,
                                federation.local_epochs, generator)
    return [problem.client_samples[client][p] for p in positions]


def straggler_steps(planned, round_index, client, stragglers):
    """The steps a straggler does, written out: ceil(K_i * its speed class * its jitter of the round), at
    least 1, at most the deadline; its class drawn once per run, its jitter each round, as every rank
    draws them."""
    speed = stragglers.speeds[seeded_numpy_generator(SEED, SPEED_STREAM, client).integers(len(stragglers.speeds))]
    jitter = 1 - stragglers.jitter * seeded_numpy_generator(SEED, STEPS_STREAM, round_index, client).random()
    steps = max(1, math.ceil(planned * speed * jitter - 1e-9))
    return steps if stragglers.deadline is None else min(steps, stragglers.deadline)


HIDDEN, PROJECTION = 16, 32


def moon_setup(root, out_dir, **federation):
    """small_setup with a one-layer MLP, whose features MOON's head projects."""
    setup = small_setup(root, out_dir, **federation)
    setup["model"] = ModelArgs(name="mlp", options={"hidden": HIDDEN, "depth": 1})
    return setup
