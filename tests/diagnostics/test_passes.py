"""The diagnostics' passes through the model (`diag_forward_passes`, `diag_grad_evals`) against an
independent count by hooks on the model's first layer, taken as what a run with the diagnostic runs
beyond the same run without it; the method's own counters (`cost_*`) the same with and without them;
the totals cumulative and saved with the diagnostic's state."""

import pytest
import torch
from diagnostic_problems import federated_loop, tiny_network_problem
from pass_counter import PassCounter

from fl_lightning.algorithms import CTPFL
from fl_lightning.diagnostics.base import DIAG_FORWARD_PASSES, DIAG_GRAD_EVALS, HVP_PASSES
from fl_lightning.diagnostics.ctpfl import DisplacementBias
from fl_lightning.diagnostics.gsnr import GSNR, GradientVariance, WeightNorms
from fl_lightning.diagnostics.landscape import Landscape
from fl_lightning.diagnostics.local_updates import DriftDiversity
from fl_lightning.federation.costs import CLIENT_SECONDS, COUNTERS

ROUNDS = 4
SUBSET, CHUNK = 20, 8  # the landscape's subset in three forward passes (8, 8 and 4 samples)
CHUNKS = 3


def passes_per_round(callbacks: list, client_path: str = "loop") -> tuple[list[dict], list[tuple[int, int]]]:
    """The rows of a CTP-FL run of the tiny network, three clients of four a round, and the passes the
    hooks counted in each of its rounds (callbacks included)."""
    network, images, labels, partition, _ = tiny_network_problem()
    engine, loop = federated_loop(network, images, labels, partition, CTPFL(span=0.2), callbacks, local_steps=3,
                                  batch_size=4, clients_per_round=3, num_classes=3, rounds=ROUNDS,
                                  client_path=client_path)
    counter = PassCounter(loop.module.network.conv)
    rows, counted = [], []
    engine.call("on_fit_start", engine, loop)
    for round_index in range(ROUNDS):
        before = counter.forward, counter.backward
        rows += run_rounds_from(engine, loop, round_index)
        counted.append((counter.forward - before[0], counter.backward - before[1]))
    return rows, counted


def run_rounds_from(engine, loop, round_index: int) -> list[dict]:
    engine.call("on_round_start", engine, loop, round_index)
    metrics = loop.run_round(round_index)
    engine.call("on_round_end", engine, loop, metrics)
    return [metrics]


def landscape(hvp: str) -> Landscape:
    return Landscape(every=3, subset_size=SUBSET, batch_size=CHUNK, iterations=3, probes=2, hvp=hvp)


DIAGNOSTICS = {
    "DisplacementBias": lambda: DisplacementBias(every=2),
    "GradientVariance": lambda: GradientVariance(num_batches=2, batch_size=3),
    "GSNR": lambda: GSNR(every=2, num_batches=3, batch_size=2),
    "Landscape": lambda: landscape("double_backward"),
    "DriftDiversity": DriftDiversity,
    "WeightNorms": WeightNorms,
}


def method_counters(row: dict) -> dict:
    return {key: row[key] for key in COUNTERS if key != CLIENT_SECONDS}


@pytest.mark.parametrize("client_path", ["loop", "grouped"])
@pytest.mark.parametrize("name", DIAGNOSTICS)
def test_a_diagnostics_passes_are_what_hooks_count_beyond_the_run_without_it(name, client_path):
    """On the grouped path CTP-FL's clients are fused, and a diagnostic that reads a client's own
    upload has it computed again: its local steps' passes, counted as the diagnostic's."""
    plain_rows, plain = passes_per_round([], client_path)
    rows, measured = passes_per_round([DIAGNOSTICS[name]()], client_path)
    assert [method_counters(row) for row in rows] == [method_counters(row) for row in plain_rows]
    forward = backward = 0
    for row, (forward_with, backward_with), (forward_without, backward_without) in zip(rows, measured, plain):
        extra_forward, extra_backward = forward_with - forward_without, backward_with - backward_without
        if name == "Landscape":  # a forward pass a chunk for the loss, then a forward pass a chunk per HVP
            hvp_chunks = (extra_forward - CHUNKS) if extra_forward else 0
            extra_forward = extra_forward and CHUNKS + HVP_PASSES * hvp_chunks
            extra_backward = HVP_PASSES * hvp_chunks
        forward, backward = forward + extra_forward, backward + extra_backward
        assert (row[DIAG_FORWARD_PASSES], row[DIAG_GRAD_EVALS]) == (forward, backward), row["round"]
    if name != "WeightNorms" and (name != "DriftDiversity" or client_path == "grouped"):
        assert backward > 0


def test_an_hvp_counts_the_same_however_it_is_computed():
    rows = {hvp: passes_per_round([landscape(hvp)])[0][-1] for hvp in ("jvp", "double_backward")}
    assert rows["jvp"][DIAG_GRAD_EVALS] == rows["double_backward"][DIAG_GRAD_EVALS] > 0
    assert rows["jvp"][DIAG_FORWARD_PASSES] == rows["double_backward"][DIAG_FORWARD_PASSES]


def test_the_diagnostics_passes_add_up_and_each_keeps_its_own_in_its_state():
    singles = {name: passes_per_round([DIAGNOSTICS[name]()])[0] for name in ("DisplacementBias", "GSNR")}
    together = [DIAGNOSTICS["DisplacementBias"](), DIAGNOSTICS["GSNR"]()]
    rows, _ = passes_per_round(together)
    for key in (DIAG_FORWARD_PASSES, DIAG_GRAD_EVALS):
        assert [row[key] for row in rows] == [a[key] + b[key] for a, b in zip(*singles.values())]
    for diagnostic, name in zip(together, singles):
        assert diagnostic.state_dict() == {"passes": {key: singles[name][-1][key]
                                                      for key in (DIAG_FORWARD_PASSES, DIAG_GRAD_EVALS)}}
    resumed = DIAGNOSTICS["GSNR"]()
    resumed.load_state_dict(together[1].state_dict())
    assert resumed.passes == together[1].passes


class OneRank:
    world_size = 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_counts_stay_exact_in_a_reduction_of_low_precision_values(dtype):
    """bfloat16 holds the integers exactly only up to 256: the counts travel at float32 at least."""
    diagnostic = GSNR()
    values = torch.tensor([1.5, -2.25], dtype=dtype)
    diagnostic.count_passes(1001, 4097)
    total = diagnostic.reduced(OneRank(), values)
    assert total.dtype == dtype and torch.equal(total, values)
    assert diagnostic.passes == {DIAG_FORWARD_PASSES: 1001, DIAG_GRAD_EVALS: 4097}
