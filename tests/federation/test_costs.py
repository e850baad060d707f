"""The run's cost counters (`fl_lightning/federation/costs.py`) against an independent count: the passes
through the model counted by hooks on its first layer, the bytes of what each rule needs at the client
and sends back written out here from the rules themselves; the grouped path, two ranks and a resumed run
count the same; and the equal-cost claims of the papers (CTP-FL and FedAvg-M, FedSAM, SCAFFOLD)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import processes
import pytest
import torch
from lightning.fabric import Fabric
from pass_counter import PassCounter
from paths import REPOSITORY
from reference import moon_setup
from torch import nn

from fl_lightning.algorithms import (
    CTPFL,
    MOON,
    SCAFFOLD,
    SHORT_NAMES,
    FedAvg,
    FedAvgClientMomentum,
    FedAvgServerMomentum,
    FedCM,
    FedDyn,
    FedProx,
    FedSAM,
)
from fl_lightning.clients.run import batch_positions, seeded_generator
from fl_lightning.config import ClientOptimizerArgs, ComputeArgs, DataArgs, FabricArgs, FederationArgs
from fl_lightning.constraints import CONST
from fl_lightning.data import ImageDataset
from fl_lightning.federation.aggregation import round_clients
from fl_lightning.federation.costs import (
    CLIENT_SECONDS,
    COUNTERS,
    DOWNLOAD_BYTES,
    FORWARD_PASSES,
    GRAD_EVALS,
    SAMPLES,
    UPLOAD_BYTES,
    ModelSizes,
    RunCosts,
    samples_of_steps,
    short_upload_elements,
)
from fl_lightning.federation.loop import FederatedLoop
from fl_lightning.federation.setup import RunData, RunSettings, rank_inputs
from fl_lightning.fit import fit
from fl_lightning.models import FeatureClassifier
from fl_lightning.run_logging import read_metrics
from fl_lightning.server_optimizers import ServerSGD, ServerState

NUM_CLASSES = 3
CLIENT_SIZES = (13, 20, 7, 16, 24)
ROUNDS = 4
SERVER_LR = 0.5
CLIENT_LR = 0.05

ALGORITHMS = {
    "fedavg": FedAvg, "fedavg_server_momentum": FedAvgServerMomentum, "fedavg_client_momentum": FedAvgClientMomentum,
    "fedcm": FedCM, "scaffold": SCAFFOLD, "fedprox": lambda: FedProx(mu=0.1), "feddyn": lambda: FedDyn(alpha=0.1),
    "fedsam": lambda: FedSAM(rho=0.05), "moon": lambda: MOON(mu=1.0, projection_dim=6),
    "ctpfl": lambda: CTPFL(span=0.2),
}
STATELESS_SERVER = {"fedavg_server_momentum"}  # its momentum is the server optimizer's (lr 1 here)

# What each rule needs at a client beside the model x and its BatchNorm statistics, and what a client
# sends back beside its update and statistics, read off the rules (their modules' docstrings):
SERVER_VECTORS_READ = {"scaffold": "control"}  # c, in g - c_i + c
STEP_DIRECTIONS = {"fedavg_client_momentum", "fedcm", "ctpfl"}  # g^r / Delta^r / v: the server's last step
EXTRA_UPLOADS = {"scaffold": 1}  # c_i+ - c_i beside x - y_i


class SmallNet(FeatureClassifier):
    """conv -> (BatchNorm) -> ReLU -> pool -> linear features -> classifier; every pass starts at conv."""

    def __init__(self, batch_norm: bool, bias: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=bias)
        self.norm = nn.BatchNorm2d(4) if batch_norm else nn.Identity()
        self.features = nn.Linear(4 * 4 * 4, 8, bias=bias)
        self.feature_dim = 8
        self.classifier = nn.Linear(8, NUM_CLASSES, bias=bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)
        return torch.relu(self.features(x.flatten(1)))


def federated_loop(name: str, client_path: str, constraint=None, **federation) -> FederatedLoop:
    torch.manual_seed(0)
    network = SmallNet(batch_norm=constraint is None, bias=constraint is None)
    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (sum(CLIENT_SIZES), 3, 8, 8), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (sum(CLIENT_SIZES),), generator=generator)
    dataset = ImageDataset(images, labels, NUM_CLASSES, (0.5,) * 3, (0.25,) * 3)
    partition = np.split(np.arange(sum(CLIENT_SIZES)), np.cumsum(CLIENT_SIZES)[:-1])
    federation = {"local_steps": 3, "clients_per_round": 3, **federation}
    settings = RunSettings(
        algorithm=ALGORITHMS[name](),
        server_optimizer=ServerSGD(lr=1.0 if name in STATELESS_SERVER else SERVER_LR),
        federation=FederationArgs(rounds=ROUNDS, num_clients=len(CLIENT_SIZES), batch_size=5, **federation),
        data=DataArgs(augment=False),
        client_optimizer=ClientOptimizerArgs(lr=CLIENT_LR, momentum=0.0 if name in STEP_DIRECTIONS else 0.9),
        constraint=constraint,
        compute=ComputeArgs(client_path=client_path),
    )
    run = rank_inputs(settings, out_dir=Path("unused"), run_id="test", hyperparameters={},
                      data=RunData(dataset, dataset, partition), network=network)
    return FederatedLoop(Fabric(accelerator="cpu", devices=1, precision="32-true"), run)


def first_layer(loop: FederatedLoop) -> nn.Module:
    network = loop.module.network
    return network.encoder.conv if hasattr(network, "encoder") else network.conv


def direction_from_models(name: str, previous: torch.Tensor, current: torch.Tensor, steps: int) -> torch.Tensor:
    """A step direction a client rebuilds from two consecutive global models: CTP-FL's v = (x^{r-1} - x^r) /
    gamma, FedAvg-M's g = (x^{r-1} - x^r) / (gamma lr K)."""
    step = (previous - current) / SERVER_LR
    return step if name == "ctpfl" else step / (CLIENT_LR * steps)


def independent_count(name: str, loop: FederatedLoop) -> list[dict]:
    """Each round's counters of `loop` by hooks and by the rules' definitions; checks on the way that the
    step directions counted as rebuilt are indeed the server's last step."""
    counter = PassCounter(first_layer(loop))
    model = loop.global_model.params.numel() * loop.global_model.params.element_size()
    buffers = loop.global_model.buffers.numel() * loop.global_model.buffers.element_size()
    federation = loop.inputs.settings.federation
    totals, rows, previous_drawn, previous_model = dict.fromkeys(COUNTERS[:-1], 0), [], None, None
    for round_index in range(ROUNDS):
        taking_part = round_clients(loop.inputs.settings.seed, round_index, federation)
        down = model + buffers
        if name in SERVER_VECTORS_READ:
            down += loop.server_state.tensors[SERVER_VECTORS_READ[name]].numel() * 4
        tensors = loop.server_state.tensors
        if name in STEP_DIRECTIONS and previous_model is not None:
            direction = tensors["direction" if name == "ctpfl" else "global_direction"]
            rebuilt = direction_from_models(name, previous_model, loop.global_model.params, federation.local_steps)
            torch.testing.assert_close(rebuilt, direction, rtol=1e-4, atol=1e-6)
        for client in taking_part.drawn:
            rebuilds = previous_drawn is None or client in previous_drawn
            totals[DOWNLOAD_BYTES] += down + (model if name in STEP_DIRECTIONS and not rebuilds else 0)
            totals[SAMPLES] += federation.local_steps * federation.batch_size
        totals[UPLOAD_BYTES] += len(taking_part.reported) * ((1 + EXTRA_UPLOADS.get(name, 0)) * model + buffers)
        previous_drawn, previous_model = set(taking_part.drawn), loop.global_model.params.clone()
        row = loop.run_round(round_index)
        totals[FORWARD_PASSES], totals[GRAD_EVALS] = counter.forward, counter.backward
        rows.append((row, dict(totals)))
    return rows


def counters(row: dict) -> dict:
    return {key: row[key] for key in COUNTERS if key != CLIENT_SECONDS}


CASES = [(name, None) for name in ALGORITHMS] + [(name, "const") for name in ALGORITHMS if name != "ctpfl"]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "constraint"), CASES)
def test_counters_equal_hooks_and_the_rules_bytes_on_both_client_paths(name, constraint):
    """Three of five clients a round, so that clients miss rounds: MOON's first round has no contrastive
    passes, and a client not drawn in the round before receives the step direction it cannot rebuild."""
    def loop_of(client_path):
        return federated_loop(name, client_path, constraint=CONST() if constraint else None)

    looped = independent_count(name, loop_of("loop"))
    for row, expected in looped:
        assert counters(row) == expected
        assert row[CLIENT_SECONDS] > 0
    grouped = loop_of("grouped")
    assert [counters(grouped.run_round(r)) for r in range(ROUNDS)] == [counters(row) for row, _ in looped]


def last_counters(name: str, **federation) -> dict:
    loop = federated_loop(name, "loop", **federation)
    return counters([loop.run_round(r) for r in range(ROUNDS)][-1])


def test_equal_rounds_are_equal_cost_for_ctpfl_and_fedavg_m_not_for_fedsam_or_scaffold():
    """CTP-FL's claim: K gradient evaluations and one model-sized vector each way, as full-participation
    FedAvg-M; FedSAM evaluates twice per step; SCAFFOLD sends two vectors each way (no BatchNorm here)."""
    full = dict(clients_per_round=len(CLIENT_SIZES), constraint=CONST())
    ctpfl, fedavg_m = last_counters("ctpfl", clients_per_round=len(CLIENT_SIZES)), last_counters(
        "fedavg_client_momentum", clients_per_round=len(CLIENT_SIZES))
    assert ctpfl == fedavg_m
    fedavg, fedsam, scaffold = (last_counters(name, **full) for name in ("fedavg", "fedsam", "scaffold"))
    assert fedsam[GRAD_EVALS] == 2 * fedavg[GRAD_EVALS] > 0
    assert scaffold[UPLOAD_BYTES] == 2 * fedavg[UPLOAD_BYTES] > 0
    assert scaffold[DOWNLOAD_BYTES] == 2 * fedavg[DOWNLOAD_BYTES]


def test_fedavg_m_sends_its_direction_when_clients_take_unequal_steps():
    """With local epochs over unequal clients g^r is no multiple of the server's step: it goes down."""
    loop = federated_loop("fedavg_client_momentum", "loop", local_steps=None, local_epochs=1)
    model = loop.global_model.params.numel() * 4 + loop.global_model.buffers.numel() * 4
    rows = [loop.run_round(r) for r in range(ROUNDS)]
    drawn = sum(len(round_clients(loop.inputs.settings.seed, r, loop.inputs.settings.federation).drawn)
                for r in range(ROUNDS))
    first = len(round_clients(loop.inputs.settings.seed, 0, loop.inputs.settings.federation).drawn)
    params = loop.global_model.params.numel() * 4
    assert rows[-1][DOWNLOAD_BYTES] == drawn * model + (drawn - first) * params


@pytest.mark.parametrize("local_epochs", [None, 1, 3])
def test_samples_of_a_clients_steps_are_those_of_its_batches(local_epochs):
    federation = FederationArgs(rounds=1, num_clients=1, clients_per_round=1, batch_size=5, local_epochs=local_epochs,
                                local_steps=None if local_epochs else 7)
    for num_samples in (3, 13, 20):
        positions = batch_positions(num_samples, 5, federation.local_steps, local_epochs, seeded_generator(0))
        for steps in range(len(positions) + 1):
            assert samples_of_steps(num_samples, steps, federation) == sum(len(p) for p in positions[:steps])


def test_a_history_logged_before_the_counters_gives_none():
    """Counting on from zero after such a resume would be silently wrong."""
    loop = federated_loop("fedavg", "loop")
    costs: RunCosts = loop.costs
    costs.resume([{"round": 1, "train_loss": 1.0}])
    assert costs.after_round(1, round_clients(0, 1, loop.inputs.settings.federation), 1.0) == {}


def moon_fit(root, out_dir: Path, rounds: int, resume=None, **settings) -> dict:
    """fit()'s keyword arguments of a small MOON run, three clients of five a round."""
    setup = moon_setup(root, out_dir, rounds=rounds, eval_every=2)
    setup.update(resume=resume, **settings)
    return dict(algorithm=MOON(mu=1.0, projection_dim=8), client_optimizer=ClientOptimizerArgs(lr=0.05), **setup)


def logged_counters(out_dir: Path) -> list[dict]:
    return [counters(row) for row in read_metrics(out_dir)]


@pytest.mark.slow
def test_a_resumed_run_ends_with_the_uninterrupted_runs_counters(cifar_root, tmp_path):
    """MOON's passes depend on who reported before the checkpoint, which the resume replays."""
    fit(**moon_fit(cifar_root, tmp_path / "a", 4))
    uninterrupted = logged_counters(tmp_path / "a")
    fit(**moon_fit(cifar_root, tmp_path / "b", 2))
    checkpoint = torch.load(tmp_path / "b" / "checkpoints" / "last.ckpt", weights_only=False)
    assert counters(checkpoint["metrics"][-1]) == uninterrupted[1]
    fit(**moon_fit(cifar_root, tmp_path / "b", 4, resume="auto"))
    assert logged_counters(tmp_path / "b") == uninterrupted
    assert uninterrupted[-1][FORWARD_PASSES] > uninterrupted[-1][GRAD_EVALS]  # contrastive rounds were counted


@pytest.mark.multiprocess
@pytest.mark.parametrize("client_path", ["loop", "grouped"])
def test_two_ranks_count_as_one(cifar_root, tmp_path, client_path):
    compute = ComputeArgs(client_path=client_path)
    fit(**moon_fit(cifar_root, tmp_path / "one", 3, compute=ComputeArgs(client_path="loop")))
    two_ranks = FabricArgs(accelerator="cpu", devices=2, process_group_timeout_s=120)
    processes.call_on_ranks(2, fit, **moon_fit(cifar_root, tmp_path / "two", 3, fabric=two_ranks, compute=compute))
    assert logged_counters(tmp_path / "two") == logged_counters(tmp_path / "one")


def steps_of(passes_on_later_rounds: int, passes_on_first: int) -> str:
    def times_k(count: int) -> str:
        return "K" if count == 1 else f"{count}K"

    shown = times_k(passes_on_later_rounds)
    if passes_on_first == passes_on_later_rounds:
        return shown
    return f"{shown} ({times_k(passes_on_first)} on a client's first round)"


def declared_row(algorithm_class) -> list[str]:
    """The docs' row of a method, from its declaration."""
    algorithm, cost = algorithm_class(), algorithm_class.cost
    later, first = algorithm.step_passes(True), algorithm.step_passes(False)
    scalars = short_upload_elements(algorithm_class)
    down = str(1 + len(cost.sent_down))
    if cost.rebuilt_down:
        down += f", or {int(down) + len(cost.rebuilt_down)} where its direction cannot be rebuilt"
    return [f"`{algorithm_class.short_name}`", steps_of(later.backward, first.backward),
            steps_of(later.forward, first.forward),
            str(cost.uploads) + (f" and {scalars} number" + "s" * (scalars > 1) if scalars else ""), down]


def test_the_docs_table_of_methods_is_their_declared_cost():
    text = (REPOSITORY / "docs" / "experiments.md").read_text()
    table = text[text.index("| method | gradient evaluations |"):].split("\n\n")[0].splitlines()[2:]
    documented = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    assert documented == [declared_row(SHORT_NAMES[name]) for name in sorted(SHORT_NAMES)]


def test_short_uploads_are_counted_at_their_length_weighted_or_summed():
    class WithShortUploads(FedAvg):
        weighted_short_uploads = {"norm": 1}
        summed_short_uploads = {"counts": 3}

    params, buffers = torch.zeros(10, dtype=torch.float32), torch.zeros(2, dtype=torch.float64)
    server = ServerState(optimizer=ServerSGD(), num_clients=4)
    plain, short = (ModelSizes(algorithm, params, buffers, server) for algorithm in (FedAvg(), WithShortUploads()))
    # Four numbers more a client, at the model's dtype (4 bytes each): 10 * 4 + 2 * 8 bytes without them.
    assert (plain.upload, short.upload) == (10 * 4 + 2 * 8, 10 * 4 + 2 * 8 + (1 + 3) * 4)
