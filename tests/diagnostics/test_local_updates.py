"""Diagnostics of client updates, gradient statistics and weight sizes: each checked against a
direct computation on known uploads and gradients (hooks called on a stub loop, on one rank and on
two simulated ranks), and end to end: on the scheduled rounds only, without changing training."""

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import yaml
from diagnostic_problems import NUM_CLIENTS, NUM_PARAMS, SAMPLES, by_hand, known_round
from paths import QUICKSTART

from fl_lightning.algorithms.base import PSEUDO_GRADIENT
from fl_lightning.checkpoint import checkpoint_dir
from fl_lightning.clients.run import seeded_generator
from fl_lightning.commands.main import main
from fl_lightning.diagnostics.base import DIAG_COUNTERS
from fl_lightning.diagnostics.gsnr import GSNR, GradientVariance, WeightNorms
from fl_lightning.diagnostics.local_updates import ClientConsistency, ClientDrift, DriftDiversity, UpdateCosine
from fl_lightning.errors import ConfigError
from fl_lightning.flat import FlatLayout
from fl_lightning.run_logging import read_metrics

ROUNDS, EVERY = 3, 2  # rounds 2 (every) and 3 (the last) are measured, round 1 is not


# --- a stub loop, fabric, trainer and clients with known data --------------------------------------

class Ranks:
    """Simulated ranks in threads: all_reduce(sum) adds every rank's tensor in rank order."""

    def __init__(self, world_size: int):
        self.slots = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=30)


class StubFabric:
    device = torch.device("cpu")

    def __init__(self, rank: int = 0, ranks: Ranks = None):
        self.global_rank, self.ranks = rank, ranks
        self.world_size = 1 if ranks is None else len(ranks.slots)
        self.reductions = 0

    def all_reduce(self, tensor, reduce_op):
        assert reduce_op == "sum"
        self.reductions += 1
        self.ranks.slots[self.global_rank] = tensor.clone()
        self.ranks.barrier.wait()
        total = sum(self.ranks.slots[1:], self.ranks.slots[0].clone())
        self.ranks.barrier.wait()
        return total


class StubTrainer:
    """Sample k of client m has the known "gradient" data[m][k] (float32; a linear loss), whatever
    the parameters. Every gradient draws from the global random state, so the tests see whether a
    diagnostic restores it."""

    def __init__(self, data: list[torch.Tensor]):
        self.samples = torch.cat(data).float()
        offsets = [0, *itertools.accumulate(len(d) for d in data)]
        self.client_indices = [torch.arange(a, b) for a, b in zip(offsets, offsets[1:])]
        self.seed = 3
        self.batches: list[torch.Tensor] = []

    def client(self, client_id: int, round_index: int, params: torch.Tensor, projection=None) -> "StubClient":
        return StubClient(self, client_id, round_index, params, projection)

    def make_batches(self, sample_indices, positions, generator):
        batches = []
        for batch_positions in positions:
            indices = sample_indices[batch_positions]
            self.batches.append(indices.clone())
            batches.append((self.samples[indices], indices))
        return batches


class StubClient:
    """What a diagnostic asks of a client (`ClientRound`'s methods for diagnostics), on the stub's data."""

    def __init__(self, trainer: StubTrainer, client_id: int, round_index: int, params: torch.Tensor, projection):
        self.trainer, self.client_id, self.round, self.global_params = trainer, client_id, round_index, params
        self.projection = projection
        self.num_samples = len(trainer.client_indices[client_id])

    def generator(self, stream: int) -> torch.Generator:
        return seeded_generator(self.trainer.seed, stream, self.round, self.client_id)

    def draw_batches(self, positions, generator):
        return self.trainer.make_batches(self.trainer.client_indices[self.client_id], positions, generator)

    def gradient_at(self, params, batch):
        torch.rand(3)  # as dropout would
        assert not params.requires_grad
        return batch[0].mean(dim=0)


def stub_loop(params: torch.Tensor, rounds: int = ROUNDS):
    layout = FlatLayout(("layer.weight", "layer.bias"), (torch.Size([2, 2]), torch.Size([1])))
    federation = SimpleNamespace(num_clients=NUM_CLIENTS, batch_size=1)
    return SimpleNamespace(rounds=rounds, inputs=SimpleNamespace(settings=SimpleNamespace(federation=federation)),
                           global_model=SimpleNamespace(param_layout=layout, params=params,
                                                        buffer_layout=FlatLayout((), ())))


def run_hooks(diagnostic, rank: int, ranks, clients_of_round, seed: int = 0):
    """The loop's hook sequence for ROUNDS rounds on one rank: its clients of each round (by
    round number) get on_client_end; returns each round's metrics and the reductions made per round.
    On unmeasured rounds clients upload an empty dict, which a diagnostic must not touch."""
    uploads, weights, data, params = known_round(seed)
    fabric, loop, trainer = StubFabric(rank, ranks), stub_loop(params), StubTrainer(data)
    rows, reductions = [], []
    for round_index in range(ROUNDS):
        measured = (round_index + 1) % EVERY == 0 or round_index + 1 == ROUNDS
        before = fabric.reductions
        diagnostic.on_round_start(fabric, loop, round_index)
        for client_id in clients_of_round(round_index + 1):
            client = trainer.client(client_id, round_index, params)
            diagnostic.on_client_end(fabric, loop, client, {PSEUDO_GRADIENT: uploads[client_id]} if measured else {},
                                     weights[client_id])
        metrics = {"round": round_index + 1}
        diagnostic.on_round_end(fabric, loop, metrics)
        rows.append(metrics)
        reductions.append(fabric.reductions - before)
    return rows, reductions


ALL_CLIENTS = lambda round_number: range(NUM_CLIENTS)  # noqa: E731


# --- the definitions, computed directly ------------------------------------------------------------


def diagnostics():
    return [ClientDrift(every=EVERY), DriftDiversity(every=EVERY), ClientConsistency(every=EVERY),
            UpdateCosine(every=EVERY), GradientVariance(every=EVERY, num_batches=10),
            GSNR(every=EVERY, num_batches=10, per_layer=True, update_fraction=0.4)]


def without_passes(row: dict) -> dict:
    """The row without the diagnostics' pass counters (tests/diagnostics/test_passes.py checks those)."""
    return {k: v for k, v in row.items() if k not in DIAG_COUNTERS}


def measured_rows(rows):
    return {row["round"]: {k: v for k, v in without_passes(row).items() if k != "round"} for row in rows}


# --- tests -------------------------------------------------------------------------------------------

def test_each_diagnostic_matches_its_definition_on_known_uploads_and_gradients():
    expected = by_hand()
    global_rng = torch.get_rng_state()
    found = {}
    for diagnostic in diagnostics():
        rows = measured_rows(run_hooks(diagnostic, 0, None, ALL_CLIENTS)[0])
        assert rows[1] == {}, type(diagnostic).__name__  # round 1 is not measured
        assert rows[2].keys() == rows[3].keys() and rows[2], type(diagnostic).__name__
        found.update(rows[2])
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        assert found[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
    assert found["drift_diversity"] >= 1
    # The diagnostics' own gradients left the global random state as it was.
    assert torch.equal(torch.get_rng_state(), global_rng)


def test_on_two_ranks_one_all_reduce_on_measured_rounds_only_and_the_same_metrics():
    single = [measured_rows(run_hooks(d, 0, None, ALL_CLIENTS)[0]) for d in diagnostics()]
    # Round 3: all clients on rank 0, none on rank 1 (which still joins the reduction).
    split = {1: ([0, 2, 4], [1, 3, 5]), 2: ([1, 2], [0, 3, 4, 5]), 3: (list(range(NUM_CLIENTS)), [])}
    ranks = Ranks(2)
    for index, pair in enumerate(zip(diagnostics(), diagnostics())):
        with ThreadPoolExecutor(2) as pool:
            results = [pool.submit(run_hooks, diagnostic, rank, ranks, lambda r, rank=rank: split[r][rank])
                       for rank, diagnostic in enumerate(pair)]
            results = [f.result(timeout=60) for f in results]
        for rows, reductions in results:
            assert reductions == [0, 1, 1]
            rows = measured_rows(rows)
            assert rows.keys() == single[index].keys()
            for round_number, row in rows.items():
                assert row.keys() == single[index][round_number].keys()
                for name, value in row.items():
                    assert value == pytest.approx(single[index][round_number][name], rel=1e-9, abs=1e-12), name


def test_gradient_variance_of_sampled_mini_batches_projected_from_a_stream_of_its_own():
    uploads, weights, data, params = known_round(1)
    trainer, loop, fabric = StubTrainer(data), stub_loop(params, rounds=1), StubFabric()
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0])  # a "projection" that drops the first coordinate
    diagnostic = GradientVariance(num_batches=2, batch_size=2)
    diagnostic.on_round_start(fabric, loop, 0)
    batches_seen = []
    for client_id in range(NUM_CLIENTS):
        client = trainer.client(client_id, 0, params, projection=lambda g: g * mask)
        trainer.batches.clear()
        diagnostic.on_client_end(fabric, loop, client, {PSEUDO_GRADIENT: uploads[client_id]}, weights[client_id])
        batches_seen.append([b.tolist() for b in trainer.batches])
    metrics = {"round": 1}
    diagnostic.on_round_end(fabric, loop, metrics)

    # Clients with fewer than 4 samples have room for one batch of 2 only: no variance, left out.
    counted, variance, means = 0.0, 0.0, []
    for client_id, batches in enumerate(batches_seen):
        if SAMPLES[client_id] < 4:
            assert batches == []
            continue
        indices = trainer.client_indices[client_id].tolist()
        assert len(batches) == 2 and all(len(b) == 2 for b in batches)
        assert len(set(sum(batches, []))) == 4 and set(sum(batches, [])) <= set(indices)
        gradients = torch.stack([trainer.samples[b].mean(dim=0) * mask for b in batches]).double()
        variance += weights[client_id] * gradients.var(dim=0, unbiased=True).sum().item()
        means.append((weights[client_id], gradients.mean(dim=0)))
        counted += weights[client_id]
    overall = sum(w * m for w, m in means) / counted
    between = sum(w * (m - overall).pow(2).sum() for w, m in means) / counted
    assert metrics["gradient_variance"] == pytest.approx(variance / counted, rel=1e-9)
    assert metrics["gradient_variance/between_clients"] == pytest.approx(between.item(), rel=1e-9)

    # The samples come from the diagnostic's own stream: the same ones again for the same round.
    trainer.batches.clear()
    GradientVariance(num_batches=2, batch_size=2).on_client_end(
        fabric, loop, trainer.client(0, 0, params),
        {PSEUDO_GRADIENT: uploads[0]}, weights[0])
    assert [b.tolist() for b in trainer.batches] == batches_seen[0]


def test_weight_norms_per_layer_of_the_global_model():
    params = torch.tensor([3.0, 4.0, 0.0, 12.0, -2.0])
    loop, fabric = stub_loop(params, rounds=4), StubFabric()
    rows = []
    for round_number in range(1, 5):
        metrics = {"round": round_number}
        WeightNorms(every=3).on_round_end(fabric, loop, metrics)
        assert [metrics.pop(key) for key in DIAG_COUNTERS] == [0, 0]
        rows.append(metrics)
    assert rows[0] == {"round": 1} and rows[1] == {"round": 2}
    assert rows[2] == rows[3] | {"round": 3} and rows[3]["weight_norm/layer.weight"] == 13.0
    assert "weight_norm/layer.bias" not in rows[3]
    metrics = {"round": 1}
    WeightNorms(all_parameters=True).on_round_end(fabric, loop, metrics)
    assert without_passes(metrics) == {"round": 1, "weight_norm/layer.weight": 13.0, "weight_norm/layer.bias": 2.0}


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="every"):
        DriftDiversity(every=0)
    with pytest.raises(ConfigError, match="num_batches"):
        GradientVariance(num_batches=1)
    with pytest.raises(ConfigError, match="update_fraction"):
        GSNR(update_fraction=0.7)
    loop = stub_loop(torch.zeros(NUM_PARAMS))
    loop.global_model.buffer_layout = FlatLayout(("bn.running_mean",), (torch.Size([2]),))
    with pytest.raises(ConfigError, match="batch_size"):
        GSNR().on_fit_start(StubFabric(), loop)


ALL = ["local_updates.ClientDrift", "local_updates.DriftDiversity", "local_updates.ClientConsistency",
       "local_updates.UpdateCosine", "gsnr.GradientVariance", "gsnr.GSNR", "gsnr.WeightNorms"]
SMALL = {"gsnr.GradientVariance": {"num_batches": 3}, "gsnr.GSNR": {"num_batches": 4}}


@pytest.mark.slow
def test_end_to_end_metrics_on_scheduled_rounds_only_and_training_unchanged(tmp_path):
    """Quickstart with CONST (so that GradientVariance projects): the diagnostics' metrics are in
    metrics.jsonl on rounds 2, 4 (every 2) and 5 (the last) only, and the final model is the one
    of the same run without them, bit for bit."""
    config = tmp_path / "diagnostics.yaml"
    config.write_text(yaml.safe_dump({"callbacks": [
        {"class_path": f"fl_lightning.diagnostics.{name}", "init_args": {"every": 2, **SMALL.get(name, {})}}
        for name in ALL]}))
    tiny = ["--config", QUICKSTART, "--model.options", "{hidden: 16, depth: 1}", "--model.bias", "false",
            "--constraint", "fl_lightning.constraints.CONST", "--federation.local_steps", "2",
            "--federation.rounds", "5", "--federation.eval_every", "5", "--logger.progress_bar", "false"]
    main(["fit", *tiny, "--config", str(config), "--out_dir", str(tmp_path / "with")])
    main(["fit", *tiny, "--out_dir", str(tmp_path / "without")])

    names = ["client_drift/mean", "client_drift/max", "drift_diversity", "client_consistency", "update_cosine",
             "gradient_variance", "gradient_variance/between_clients", "gsnr/mean", "gsnr/client_sum",
             "gsnr/top_update", "weight_abs/bottom_update", "weight_norm/network.classifier.weight"]
    rows = read_metrics(tmp_path / "with")
    assert [row["round"] for row in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        present = [name for name in names if name in row]
        assert present == (names if row["round"] in (2, 4, 5) else []), row["round"]
        assert all(isinstance(row[name], float) for name in present)
    assert all(not any("/" in key for key in row) for row in read_metrics(tmp_path / "without"))

    with_diagnostics = torch.load(checkpoint_dir(tmp_path / "with") / "last.ckpt", weights_only=False)
    without = torch.load(checkpoint_dir(tmp_path / "without") / "last.ckpt", weights_only=False)
    assert with_diagnostics["model"].keys() == without["model"].keys()
    for name, tensor in without["model"].items():
        assert torch.equal(with_diagnostics["model"][name], tensor), name
    assert torch.equal(with_diagnostics["rng"], without["rng"])
    assert [row["train_loss"] for row in rows] == [row["train_loss"] for row in read_metrics(tmp_path / "without")]
