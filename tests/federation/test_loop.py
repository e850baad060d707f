"""The round loop: world-size independence, resume, run outputs, sampling."""

import json

import processes
import pytest
import torch
from reference import small_setup

from fl_lightning.algorithms import CTPFL, FedAvg
from fl_lightning.checkpoint import PARTITION_DIGEST
from fl_lightning.config import ClientOptimizerArgs, FabricArgs
from fl_lightning.federation.aggregation import aggregation_weights, clients_of_rank, sample_clients
from fl_lightning.federation.client_store import ClientStates
from fl_lightning.fit import fit
from fl_lightning.run_logging import read_metrics


def test_sampling_is_seeded_and_independent_of_rank_split():
    first = sample_clients(0, 5, 100, 10)
    assert first == sample_clients(0, 5, 100, 10)
    assert first != sample_clients(0, 6, 100, 10)
    assert len(set(first)) == 10 and all(0 <= c < 100 for c in first)
    for world_size in (1, 2, 3):
        for stateful in (False, True):
            shares = [clients_of_rank(first, r, world_size, stateful) for r in range(world_size)]
            assert sorted(c for share in shares for c in share) == first


def test_weights_follow_sample_counts_or_are_uniform():
    sizes = [10, 30, 60]
    assert aggregation_weights([0, 2], sizes, "num_samples") == {0: 10 / 70, 2: 60 / 70}
    assert aggregation_weights([0, 2], sizes, "uniform") == {0: 0.5, 2: 0.5}


@pytest.mark.multiprocess
@pytest.mark.parametrize("algorithm", [FedAvg(), CTPFL(span=0.2)])
def test_two_ranks_give_the_same_model_as_one(cifar_root, tmp_path, algorithm):
    setup = small_setup(cifar_root, tmp_path / "one", rounds=2)
    single = fit(algorithm=algorithm, client_optimizer=ClientOptimizerArgs(lr=0.05), **setup)
    setup.update(out_dir=tmp_path / "two", fabric=FabricArgs(accelerator="cpu", devices=2, process_group_timeout_s=120))
    double = processes.call_on_ranks(2, fit, algorithm=algorithm, client_optimizer=ClientOptimizerArgs(lr=0.05),
                                     **setup)
    torch.testing.assert_close(double, single, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_resume_from_mid_run_checkpoint_reproduces_the_uninterrupted_run(cifar_root, tmp_path):
    def run(out_dir, rounds, resume):
        setup = small_setup(cifar_root, out_dir, rounds=rounds, eval_every=1)
        setup["resume"] = resume
        return fit(algorithm=CTPFL(span=0.3), **setup)

    uninterrupted = run(tmp_path / "a", 4, None)
    run(tmp_path / "b", 2, None)
    resumed = run(tmp_path / "b", 4, "auto")
    torch.testing.assert_close(resumed, uninterrupted)
    assert [m["round"] for m in read_metrics(tmp_path / "b")] == [1, 2, 3, 4]
    checkpoint = torch.load(tmp_path / "b" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["round"] == 4
    assert {"model", "algorithm", PARTITION_DIGEST, "rng", "run_id"} <= set(checkpoint)
    assert checkpoint["algorithm"]["server_state"]["direction"].shape == resumed.shape


def test_run_outputs(cifar_root, tmp_path):
    setup = small_setup(cifar_root, tmp_path, rounds=2, eval_every=1)
    fit(algorithm=FedAvg(), **setup)
    metrics = read_metrics(tmp_path)
    assert [m["round"] for m in metrics] == [1, 2]
    for row in metrics:
        assert {"train_loss", "round_seconds", "test_accuracy", "test_loss"} <= set(row)
        assert 0 <= row["test_accuracy"] <= 1
    partition = json.loads((tmp_path / "partition.json").read_text())
    assert len(partition) == setup["federation"].num_clients
    indices = [i for part in partition.values() for i in part]
    assert sorted(indices) == list(range(240))
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "partition.png").exists()


def test_a_resumed_run_keeps_its_partition_plot_and_draws_a_missing_one(cifar_root, tmp_path):
    fit(algorithm=FedAvg(), **small_setup(cifar_root, tmp_path, rounds=1))
    plot = tmp_path / "partition.png"
    drawn = plot.read_bytes()
    plot.write_bytes(b"the plot the run drew")
    fit(algorithm=FedAvg(), **{**small_setup(cifar_root, tmp_path, rounds=2), "resume": "auto"})
    assert plot.read_bytes() == b"the plot the run drew"
    plot.unlink()
    fit(algorithm=FedAvg(), **{**small_setup(cifar_root, tmp_path, rounds=3), "resume": "auto"})
    assert plot.read_bytes() == drawn
    assert [row["round"] for row in read_metrics(tmp_path)] == [1, 2, 3]


def test_client_state_costs_its_raw_size_on_the_host():
    """One float32 vector per name per client that trained, kept off the accelerator, copied (not
    aliased) so the round's working tensors can be freed."""
    states = ClientStates()
    num_params, trained = 1000, [3, 7, 42]
    for client in trained:
        working = torch.full((num_params,), float(client))
        states.put(client, {"control": working})
        working.zero_()
    assert sorted(states.by_client) == trained
    stored = [t for state in states.by_client.values() for t in state.values()]
    assert sum(t.numel() * t.element_size() for t in stored) == len(trained) * num_params * 4
    assert all(t.device.type == "cpu" for t in stored)
    assert states.get(7, torch.device("cpu"))["control"].eq(7.0).all()
    assert states.get(5, torch.device("cpu")) == {}
