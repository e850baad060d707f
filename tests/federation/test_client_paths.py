"""The grouped path (clients trained together under torch.func.vmap) against the client-by-client
loop, the reference: the same global model, buffers and train loss for every algorithm, with and
without BatchNorm, under CONST, and with clients that take different numbers of steps; and CTP-FL's
fused groups (one backward pass per query point for a group), whose clients' own uploads a callback
still reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from paths import QUICKSTART
from torch import nn

import fl_lightning.federation.client_paths as client_paths
import fl_lightning.federation.groups as client_groups
from fl_lightning.algorithms import (
    CTPFL,
    MOON,
    SCAFFOLD,
    FedAvg,
    FedAvgClientMomentum,
    FedAvgServerMomentum,
    FedCM,
    FedDyn,
    FedNova,
    FedProx,
    FedSAM,
)
from fl_lightning.algorithms.base import PSEUDO_GRADIENT
from fl_lightning.callbacks import Callback
from fl_lightning.checkpoint import LAST, checkpoint_dir
from fl_lightning.commands.main import main
from fl_lightning.config import ClientOptimizerArgs, ComputeArgs, DataArgs, FederationArgs
from fl_lightning.constraints import CONST
from fl_lightning.data import ImageDataset
from fl_lightning.federation.client_paths import ClientPath, Grouping, group_size_for, uses_grouped_path
from fl_lightning.federation.global_state import FlatGlobalModel
from fl_lightning.federation.loop import FederatedLoop
from fl_lightning.federation.setup import RunData, RunSettings, rank_inputs
from fl_lightning.federation.trainer import LocalTrainer, TrainingData
from fl_lightning.models import FeatureClassifier
from fl_lightning.module import ClassificationModule
from fl_lightning.participation import Stragglers
from fl_lightning.server_optimizers import ServerSGD

NUM_CLASSES = 3
# Unequal clients: with batch 5 and 2 local epochs they take 6, 8, 4, 8 and 10 steps, most ending an
# epoch on a shorter batch.
CLIENT_SIZES = (13, 20, 7, 16, 24)


class SmallConvNet(FeatureClassifier):
    """conv -> (BatchNorm) -> ReLU -> pool -> linear features -> classifier."""

    def __init__(self, batch_norm: bool, bias: bool = True):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=bias)
        self.norm = nn.BatchNorm2d(4) if batch_norm else nn.Identity()
        self.features = nn.Linear(4 * 4 * 4, 8, bias=bias)
        self.feature_dim = 8
        self.classifier = nn.Linear(8, NUM_CLASSES, bias=bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)
        return torch.relu(self.features(x.flatten(1)))


ALGORITHMS = {
    "fedavg": FedAvg, "fedavg_server_momentum": FedAvgServerMomentum, "fedavg_client_momentum": FedAvgClientMomentum,
    "fedcm": FedCM, "fednova": FedNova, "scaffold": SCAFFOLD,
    "scaffold_effective_steps": lambda: SCAFFOLD(effective_steps=True),
    "fedprox": lambda: FedProx(mu=0.1), "feddyn": lambda: FedDyn(alpha=0.1), "fedsam": lambda: FedSAM(rho=0.05),
    "moon": lambda: MOON(mu=1.0, projection_dim=6), "ctpfl": lambda: CTPFL(span=0.2, weight_decay=1e-3, clip_norm=5.0),
}
# Without clip_norm, CTP-FL's grouped clients are fused.
FUSED_CTPFL = "ctpfl_unclipped"


def federated_loop(algorithm_name: str, *, batch_norm: bool, client_path: str, local_epochs=None, local_steps=None,
                   clients_per_round: int = 5, constraint=None, group_size=None,
                   channels_last: bool = False, precision: str = "32-true", compile_steps: bool = False,
                   client_sizes: tuple[int, ...] = CLIENT_SIZES, weighting=None, callbacks=None,
                   stragglers=None) -> FederatedLoop:
    algorithm = ALGORITHMS[algorithm_name]()
    torch.manual_seed(0)
    network = SmallConvNet(batch_norm, bias=constraint is None or constraint.constrained == "displacement")
    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (sum(client_sizes), 3, 8, 8), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (sum(client_sizes),), generator=generator)
    dataset = ImageDataset(images, labels, NUM_CLASSES, (0.5,) * 3, (0.25,) * 3)
    partition = np.split(np.arange(sum(client_sizes)), np.cumsum(client_sizes)[:-1])
    server_lr = 0.5 if algorithm_name.startswith("ctpfl") else 1.0
    settings = RunSettings(
        algorithm=algorithm, server_optimizer=ServerSGD(lr=server_lr),
        federation=FederationArgs(rounds=10**6, num_clients=len(client_sizes), clients_per_round=clients_per_round,
                                  local_steps=local_steps, local_epochs=local_epochs, batch_size=5,
                                  weighting=weighting, stragglers=stragglers),
        data=DataArgs(augment=True, crop_padding=1),
        client_optimizer=ClientOptimizerArgs(lr=0.05, momentum=0.9, weight_decay=1e-3, grad_clip_norm=2.0),
        constraint=constraint,
        compute=ComputeArgs(client_path=client_path, group_size=group_size, channels_last=channels_last,
                            compile=compile_steps),
    )
    run = rank_inputs(settings, out_dir=Path("unused"), run_id="test", hyperparameters={},
                    data=RunData(dataset, dataset, partition), network=network)
    return FederatedLoop(Fabric(accelerator="cpu", devices=1, precision=precision, callbacks=callbacks), run)


@pytest.fixture
def group_sizes(monkeypatch) -> list[int]:
    """The size of every group the grouped path computes together."""
    sizes: list[int] = []
    original = client_groups._vectorised_updates
    monkeypatch.setattr(client_groups, "_vectorised_updates", lambda algorithm, group: sizes.append(len(group)) or
                        original(algorithm, group))
    return sizes


@pytest.fixture
def fused_group_sizes(monkeypatch) -> list[int]:
    """The size of every group computed fused; also makes FUSED_CTPFL an algorithm name."""
    monkeypatch.setitem(ALGORITHMS, FUSED_CTPFL, lambda: CTPFL(span=0.2, weight_decay=1e-3))
    sizes: list[int] = []
    original = client_groups._fused_updates
    monkeypatch.setattr(client_groups, "_fused_updates", lambda algorithm, group, weights: sizes.append(len(group)) or
                        original(algorithm, group, weights))
    return sizes


def rounds_of(loop: FederatedLoop, rounds: int = 3) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    losses = [loop.run_round(round_index)["train_loss"] for round_index in range(rounds)]
    return losses, loop.global_model.params.clone(), loop.global_model.buffers.clone()


def assert_same_run(grouped, loop):
    grouped_losses, grouped_params, grouped_buffers = grouped
    loop_losses, loop_params, loop_buffers = loop
    assert grouped_losses == pytest.approx(loop_losses, rel=1e-5)
    torch.testing.assert_close(grouped_params, loop_params, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grouped_buffers, loop_buffers, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm_name", sorted(ALGORITHMS))
def test_batchnorm_clients_grouped_match_the_loop(algorithm_name, group_sizes):
    """Equal steps (local_steps): every client of the round in one group, each with its own
    BatchNorm statistics."""
    settings = dict(algorithm_name=algorithm_name, batch_norm=True, local_steps=3)
    grouped = rounds_of(federated_loop(**settings, client_path="grouped"))
    assert group_sizes and max(group_sizes) == len(CLIENT_SIZES)
    assert_same_run(grouped, rounds_of(federated_loop(**settings, client_path="loop")))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm_name", sorted(set(ALGORITHMS) - {"ctpfl"}))
def test_clients_with_fewer_steps_and_short_batches_are_masked_and_padded(algorithm_name, group_sizes):
    """local_epochs over unequal clients, without BatchNorm: the group runs the most steps of its
    clients, a client's shorter last batch of each epoch is padded, its missing steps masked.
    (CTP-FL refuses unequal step counts.)"""
    settings = dict(algorithm_name=algorithm_name, batch_norm=False, local_epochs=2)
    grouped = rounds_of(federated_loop(**settings, client_path="grouped"))
    # 10, 8, 8 and 6 steps share a group; 4 is less than half of 10, so that client runs alone.
    assert group_sizes == [4, 4, 4]
    assert_same_run(grouped, rounds_of(federated_loop(**settings, client_path="loop")))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm_name", ["fedavg", "fednova", "scaffold", "moon"])
def test_stragglers_grouped_match_the_loop(algorithm_name, group_sizes):
    """Stragglers cut each client-round's steps (a speed class, a jitter, a deadline): the group's clients
    that stop early are masked as those with fewer planned steps are."""
    stragglers = Stragglers(speeds=(0.5, 1.0), jitter=0.5, deadline=5)
    settings = dict(algorithm_name=algorithm_name, batch_norm=False, local_steps=6, stragglers=stragglers)
    grouped_loop = federated_loop(**settings, client_path="grouped")
    steps = [grouped_loop.trainer.steps_done(c, r) for r in range(3) for c in range(len(CLIENT_SIZES))]
    assert len(set(steps)) > 2 and max(steps) == 5
    grouped = rounds_of(grouped_loop)
    assert_same_run(grouped, rounds_of(federated_loop(**settings, client_path="loop")))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm_name", ["fedavg", "scaffold", "fedsam"])
def test_const_constrained_clients_grouped_match_the_loop(algorithm_name, group_sizes):
    settings = dict(algorithm_name=algorithm_name, batch_norm=False, local_epochs=2)
    grouped = rounds_of(federated_loop(**settings, client_path="grouped", constraint=CONST()))
    assert group_sizes == [4, 4, 4]
    assert_same_run(grouped, rounds_of(federated_loop(**settings, client_path="loop", constraint=CONST())))


# CONST as its authors' code runs it (configs/const_authors_code.yaml) and their per-row variant: the
# parameters mapped after each step, on clients that take unequal steps (the masked ones keep theirs).
AFTER_STEP_CONST = {
    "authors_code": dict(granularity="model", constrained="displacement", when="after_step",
                         order="centre_then_orthogonalise", tensors="all"),
    "strict": dict(constrained="displacement", when="after_step", order="strict_scale"),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", AFTER_STEP_CONST)
def test_const_mapped_after_each_step_grouped_matches_the_loop(variant, group_sizes):
    settings = dict(algorithm_name="scaffold", batch_norm=False, local_epochs=2)
    options = AFTER_STEP_CONST[variant]
    grouped = rounds_of(federated_loop(**settings, client_path="grouped", constraint=CONST(**options)))
    assert group_sizes == [4, 4, 4]
    assert_same_run(grouped, rounds_of(federated_loop(**settings, client_path="loop", constraint=CONST(**options))))


@pytest.mark.slow
def test_batchnorm_clients_group_only_with_clients_of_the_same_batch_sizes(group_sizes):
    """Padding would change BatchNorm's batch statistics: unequal clients are not grouped."""
    settings = dict(algorithm_name="fedavg", batch_norm=True, local_epochs=1)
    grouped = rounds_of(federated_loop(**settings, client_path="grouped"))
    # Sizes 13, 20, 7, 16 and 24 in batches of 5 end on different batches: 20 alone ends evenly,
    # and no two clients share a sequence of batch sizes.
    assert group_sizes == []
    assert_same_run(grouped, rounds_of(federated_loop(**settings, client_path="loop")))


@pytest.mark.slow
@pytest.mark.parametrize("weighting", ["uniform", "num_samples"])
def test_fused_ctpfl_clients_with_batchnorm_match_the_loop(weighting, fused_group_sizes, group_sizes):
    """CTP-FL's clients share their query points: a group's weighted mean upload is one backward
    pass of the weighted sum of their losses, each client normalising with its own batch statistics."""
    settings = dict(algorithm_name=FUSED_CTPFL, batch_norm=True, local_steps=3, weighting=weighting)
    fused = rounds_of(federated_loop(**settings, client_path="grouped"))
    assert fused_group_sizes == [5, 5, 5] and group_sizes == []
    assert_same_run(fused, rounds_of(federated_loop(**settings, client_path="loop")))


def test_fused_ctpfl_clients_with_shorter_last_batches_are_padded(fused_group_sizes):
    """Without BatchNorm, clients whose last batches differ share a group, padded to the longest."""
    # One epoch in batches of 5: four steps each, the last of 1 to 5 samples.
    settings = dict(algorithm_name=FUSED_CTPFL, batch_norm=False, local_epochs=1, client_sizes=(16, 20, 17, 19, 18),
                    weighting="num_samples")
    fused = rounds_of(federated_loop(**settings, client_path="grouped"))
    assert fused_group_sizes == [5, 5, 5]
    assert_same_run(fused, rounds_of(federated_loop(**settings, client_path="loop")))


def test_fused_clients_share_a_group_only_with_clients_of_as_many_steps(fused_group_sizes):
    """No step of a fused group can be masked: 13, 20, 7, 16 and 24 samples take 3, 4, 2, 4 and 5
    steps of 5, and only the two of 4 steps share a group. (A CTP-FL run refuses such clients in
    `check_federation`, which this loop, built directly, skips; the rule is for any fusing rule.)"""
    settings = dict(algorithm_name=FUSED_CTPFL, batch_norm=False, local_epochs=1)
    fused = rounds_of(federated_loop(**settings, client_path="grouped"))
    assert fused_group_sizes == [2, 2, 2]
    assert_same_run(fused, rounds_of(federated_loop(**settings, client_path="loop")))


def test_fused_groups_are_bounded_by_group_size(fused_group_sizes):
    settings = dict(algorithm_name=FUSED_CTPFL, batch_norm=True, local_steps=2)
    fused = rounds_of(federated_loop(**settings, client_path="grouped", group_size=2))
    assert fused_group_sizes == [2, 2] * 3  # and the fifth client alone
    assert_same_run(fused, rounds_of(federated_loop(**settings, client_path="loop")))


def test_fused_groups_on_the_cpu_take_at_most_512_samples_per_pass_unless_group_size_is_set(monkeypatch,
                                                                                         fused_group_sizes):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert [group_size_for(None, cpu, True, batch_size) for batch_size in (10, 50, 600)] == [51, 10, 1]
    assert group_size_for(None, cpu, False, 50) is None and group_size_for(None, gpu, True, 50) is None
    assert group_size_for(3, cpu, True, 50) == 3
    monkeypatch.setattr(client_paths, "CPU_FUSED_SAMPLES", 10)  # two clients' batches of 5
    rounds_of(federated_loop(FUSED_CTPFL, batch_norm=True, local_steps=2, client_path="auto"), rounds=1)
    assert fused_group_sizes == [2, 2]


def test_fused_ctpfl_in_bfloat16_matches_the_loop_in_bfloat16(fused_group_sizes):
    settings = dict(algorithm_name=FUSED_CTPFL, batch_norm=True, local_steps=3, precision="bf16-mixed")
    fused_losses, fused_params, _ = rounds_of(federated_loop(**settings, client_path="grouped"))
    assert fused_group_sizes == [5, 5, 5]
    loop_losses, loop_params, _ = rounds_of(federated_loop(**settings, client_path="loop"))
    assert fused_losses == pytest.approx(loop_losses, rel=1e-2)
    torch.testing.assert_close(fused_params, loop_params, rtol=0, atol=0.05)


class FusedWithState(CTPFL):
    client_state = ("last_upload",)


def test_an_algorithm_with_client_state_cannot_fuse_its_clients(monkeypatch):
    monkeypatch.setitem(ALGORITHMS, "fused_with_state", FusedWithState)
    with pytest.raises(TypeError, match="FusedWithState.fuses_clients is true, but a fused group keeps no client "
                                        "state \\(last_upload\\)"):
        federated_loop("fused_with_state", batch_norm=True, local_steps=2, client_path="grouped")


def test_clipped_ctpfl_clients_are_grouped_but_not_fused(fused_group_sizes, group_sizes):
    """Clipping each client's upload is not affine: every client's upload is computed."""
    rounds_of(federated_loop("ctpfl", batch_norm=True, local_steps=2, client_path="grouped"))
    assert fused_group_sizes == [] and group_sizes == [5, 5, 5]


class RecordsUploads(Callback):
    def __init__(self):
        self.uploads: dict[tuple[int, int], torch.Tensor] = {}

    def on_client_end(self, fabric, loop, client, uploads, weight) -> None:
        self.uploads[client.round, client.client_id] = uploads[PSEUDO_GRADIENT].clone()


@pytest.mark.slow
def test_a_callback_reads_each_fused_clients_own_upload_and_training_stays_the_same(fused_group_sizes, monkeypatch):
    """A fused client's own upload is computed, alone, only when a callback reads it; the model
    trained is bitwise the one trained without the callback."""
    settings = dict(algorithm_name=FUSED_CTPFL, batch_norm=True, local_steps=2)
    calls: list[bool] = []
    original = CTPFL.client_update
    monkeypatch.setattr(CTPFL, "client_update", lambda self, client: calls.append(
        client.execution.client_weights is not None) or original(self, client))
    plain = rounds_of(federated_loop(**settings, client_path="grouped"))
    assert calls == [True] * 3  # one fused update per round, nothing else
    calls.clear()
    fused_recorder, loop_recorder = RecordsUploads(), RecordsUploads()
    recorded = rounds_of(federated_loop(**settings, client_path="grouped", callbacks=[fused_recorder]))
    assert calls == ([True] + [False] * 5) * 3
    assert plain[0] == recorded[0] and all(torch.equal(a, b) for a, b in zip(plain[1:], recorded[1:]))
    rounds_of(federated_loop(**settings, client_path="loop", callbacks=[loop_recorder]))
    assert fused_recorder.uploads.keys() == loop_recorder.uploads.keys()
    for key, upload in loop_recorder.uploads.items():
        torch.testing.assert_close(fused_recorder.uploads[key], upload, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_stateful_clients_group_with_clients_that_have_the_same_state(group_sizes):
    """MOON branches on whether a client has a previous model: first-time and returning clients
    of a round form separate groups, and the result is still the loop's."""
    settings = dict(algorithm_name="moon", batch_norm=True, local_steps=2, clients_per_round=3)
    grouped = rounds_of(federated_loop(**settings, client_path="grouped"), rounds=4)
    assert sum(group_sizes) < 4 * 3  # some rounds mix new and returning clients
    assert_same_run(grouped, rounds_of(federated_loop(**settings, client_path="loop"), rounds=4))


@pytest.mark.slow
def test_group_size_bounds_the_groups(group_sizes):
    settings = dict(algorithm_name="scaffold", batch_norm=True, local_steps=2)
    grouped = rounds_of(federated_loop(**settings, client_path="grouped", group_size=2))
    assert group_sizes and max(group_sizes) == 2
    assert_same_run(grouped, rounds_of(federated_loop(**settings, client_path="loop")))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm_name, group_rule",
                         [("scaffold", "_vectorised_updates"), (FUSED_CTPFL, "_fused_updates")])
def test_a_group_out_of_gpu_memory_is_computed_again_in_halves(algorithm_name, group_rule, monkeypatch):
    """A group that does not fit is split until its halves do; they start from the same state, so
    the round is the loop's."""
    monkeypatch.setitem(ALGORITHMS, FUSED_CTPFL, lambda: CTPFL(span=0.2, weight_decay=1e-3))
    attempted: list[int] = []
    original = getattr(client_groups, group_rule)

    def run_group_fitting_two(algorithm, group, **weights):
        attempted.append(len(group))
        if len(group) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return original(algorithm, group, **weights)

    monkeypatch.setattr(client_groups, group_rule, run_group_fitting_two)
    settings = dict(algorithm_name=algorithm_name, batch_norm=True, local_steps=2)
    grouped = rounds_of(federated_loop(**settings, client_path="grouped"))
    assert attempted == [5, 2, 3, 2] * 3  # 5 -> 2 + 3, 3 -> 1 (alone) + 2, every round
    assert_same_run(grouped, rounds_of(federated_loop(**settings, client_path="loop")))


class ReadsANumberPerClient(FedAvg):
    """A client rule that moves a value to the host, which vmap cannot do."""

    def client_update(self, client):
        update = super().client_update(client)[PSEUDO_GRADIENT]
        return {PSEUDO_GRADIENT: update * min(1.0, 1.0 / float(update.norm()))}


def test_a_client_rule_that_cannot_run_grouped_names_the_setting_that_runs_it(monkeypatch):
    monkeypatch.setitem(ALGORITHMS, "reads_a_number", ReadsANumberPerClient)
    loop = federated_loop("reads_a_number", batch_norm=True, client_path="grouped", local_steps=2)
    with pytest.raises(RuntimeError, match="ReadsANumberPerClient.client_update cannot run grouped under "
                                           "torch.func.vmap(.|\n)*compute.client_path: loop"):
        loop.run_round(0)


def test_how_a_ranks_clients_run_is_one_value_decided_from_the_settings_and_the_algorithm(fused_group_sizes):
    def path(algorithm_name, client_path, group_size=None):
        return federated_loop(algorithm_name, batch_norm=True, local_steps=2, client_path=client_path,
                              group_size=group_size).client_path

    assert path(FUSED_CTPFL, "loop") == ClientPath(Grouping.ALONE)
    assert path("fedavg", "grouped") == ClientPath(Grouping.VECTORISED)
    assert path("fedavg", "grouped", group_size=2) == ClientPath(Grouping.VECTORISED, 2)
    assert path("ctpfl", "grouped") == ClientPath(Grouping.VECTORISED)  # clipped: not affine, not fused
    # On the CPU, fused passes of at most CPU_FUSED_SAMPLES samples: batches of 5.
    assert path(FUSED_CTPFL, "grouped") == ClientPath(Grouping.FUSED, client_paths.CPU_FUSED_SAMPLES // 5)
    assert path(FUSED_CTPFL, "grouped", group_size=3) == ClientPath(Grouping.FUSED, 3)


def test_auto_groups_on_a_gpu_and_loops_on_the_cpu_unless_the_clients_are_fused(fused_group_sizes):
    assert uses_grouped_path("auto", torch.device("cuda", 0))
    assert not uses_grouped_path("auto", torch.device("cpu"))
    assert uses_grouped_path("auto", torch.device("cpu"), fused=True)
    assert federated_loop(FUSED_CTPFL, batch_norm=True, local_steps=2, client_path="auto").client_path.grouped
    assert not federated_loop("ctpfl", batch_norm=True, local_steps=2, client_path="auto").client_path.grouped
    assert uses_grouped_path("grouped", torch.device("cpu"))
    assert not uses_grouped_path("loop", torch.device("cuda", 0))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm_name", ["fedavg", "ctpfl"])
def test_batchnorm_clients_grouped_in_bfloat16_match_the_loop_in_bfloat16(algorithm_name, group_sizes):
    """Under vmap, batch norm cannot mix bfloat16 inputs with float32 statistics; the grouped path
    feeds it float32, as it computes unbatched."""
    settings = dict(algorithm_name=algorithm_name, batch_norm=True, local_steps=3, precision="bf16-mixed")
    grouped_losses, grouped_params, _ = rounds_of(federated_loop(**settings, client_path="grouped"))
    assert max(group_sizes) == len(CLIENT_SIZES)
    loop_losses, loop_params, _ = rounds_of(federated_loop(**settings, client_path="loop"))
    assert grouped_losses == pytest.approx(loop_losses, rel=1e-2)
    torch.testing.assert_close(grouped_params, loop_params, rtol=0, atol=0.05)


@pytest.fixture
def inductor_cache_of_these_kernels(monkeypatch):
    """torch.compile's C++ kernels cached for the vector instructions ATen runs with here: torch 2.14's
    inductor cache does not key them by ATEN_CPU_CAPABILITY, and a kernel built under another one
    gave NaN or a crash. Without a vector ISA (ATEN_CPU_CAPABILITY=default) inductor's C++ code for
    these steps does not build (a torch bug: at::vec used unconditionally)."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if not cpu_vec_isa.pick_vec_isa():
        pytest.skip("torch.compile's CPU code does not build without a vector ISA in this torch")
    capability = torch.backends.cpu.get_cpu_capability().lower()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(Path(default_cache_dir()) / f"fl-lightning-{capability}"))


@pytest.mark.slow
def test_compiled_client_steps_give_the_same_model(inductor_cache_of_these_kernels):
    settings = dict(algorithm_name="scaffold", batch_norm=True, local_steps=2, client_path="loop")
    compiled = federated_loop(**settings, compile_steps=True)
    assert compiled.trainer._loop_call is not compiled.trainer._call_with_buffers
    assert_same_run(rounds_of(compiled), rounds_of(federated_loop(**settings)))


def test_channels_last_images_give_the_same_model():
    settings = dict(algorithm_name="fedavg", batch_norm=True, local_steps=2, client_path="loop")
    plain = federated_loop(**settings)
    channels_last = federated_loop(**settings, channels_last=True)
    client = channels_last.trainer.client_round(0, 0, {}, channels_last.server_state)
    inputs, _ = next(client.batches())
    assert inputs.is_contiguous(memory_format=torch.channels_last) and not inputs.is_contiguous()
    assert_same_run(rounds_of(channels_last), rounds_of(plain))


class TiedNet(FeatureClassifier):
    """Two layers that share one weight matrix (registered under both names)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(NUM_CLASSES, NUM_CLASSES)
        self.second = nn.Linear(NUM_CLASSES, NUM_CLASSES)
        self.second.weight = self.first.weight
        self.feature_dim = NUM_CLASSES
        self.classifier = nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x.flatten(1))))


def test_a_tied_weight_gets_the_gradient_of_both_uses():
    torch.manual_seed(0)
    module = ClassificationModule(TiedNet(), NUM_CLASSES)
    inputs, labels = torch.randn(6, NUM_CLASSES), torch.randint(0, NUM_CLASSES, (6,))
    loss = module.training_step((inputs, labels))
    expected = torch.autograd.grad(loss, list(module.parameters()))
    model = FlatGlobalModel.bind(module, torch.device("cpu"))
    trainer = LocalTrainer(Fabric(accelerator="cpu", devices=1), module, TrainingData(inputs, labels, None), model, [],
                           RunSettings(FedAvg()))
    _, gradient = trainer.loss_and_grad(model.params, model.buffers, (inputs, labels))
    torch.testing.assert_close(gradient, torch.cat([g.reshape(-1) for g in expected]))


@pytest.mark.slow
def test_a_grouped_run_resumed_ends_bitwise_where_an_uninterrupted_one_does(tmp_path):
    """Grouping depends only on what a checkpoint restores (each client's state and steps), not on the
    network's size: the quickstart's MLP is narrowed and its clients take a few steps."""
    arguments = ["fit", "--config", QUICKSTART, "--model.options", "{hidden: 16, depth: 1}",
                 "--federation.local_steps", "3", "--compute.client_path", "grouped", "--algorithm", "scaffold",
                 "--federation.eval_every", "2", "--checkpoint.every", "1", "--logger.progress_bar", "false"]
    main([*arguments, "--federation.rounds", "4", "--out_dir", str(tmp_path / "whole")])
    main([*arguments, "--federation.rounds", "2", "--out_dir", str(tmp_path / "resumed")])
    main([*arguments, "--federation.rounds", "4", "--out_dir", str(tmp_path / "resumed")])
    whole, resumed = (torch.load(checkpoint_dir(tmp_path / name) / LAST, weights_only=False)["model"]
                      for name in ("whole", "resumed"))
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
