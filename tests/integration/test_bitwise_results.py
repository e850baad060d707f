"""Final global models of fixed configs against the models recorded in the repository.

A refactor must not change what a run computes: each case trains a small federation in-process and
compares its final model (every parameter and buffer) with the one recorded in
tests/integration/recorded_results/final_models.pt.

- Where the torch build and the CPU's vector instructions are those of the recording
  (tests/integration/recorded_results/recorded_on.json), the models must be bitwise equal.
- Elsewhere each value must lie within TOLERANCE of the recorded one. Other vector kernels (ATen's
  AVX-512, AVX2 or none, MKL's own choice of kernel) and other thread counts sum float32 products in
  another order. Over the cases' 3 rounds that moved the final models by at most 6.0e-8 (weights of
  size up to 0.35; `python tests/integration/test_bitwise_results.py spread` measures it), while a wrong rule
  moves them by far more than TOLERANCE (the tests at the end show two).

A change that alters a result on purpose (a new default, a fixed bug) records the models again
(`python tests/integration/test_bitwise_results.py record`) in the same commit and says why.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fl_lightning.algorithms import CTPFL, MOON, SCAFFOLD, FedAvg, FedDyn, FedSAM
from fl_lightning.config import (
    CheckpointArgs,
    ClientOptimizerArgs,
    ComputeArgs,
    DataArgs,
    FabricArgs,
    FederationArgs,
    LoggerArgs,
    ModelArgs,
)
from fl_lightning.constraints import CONST
from fl_lightning.fit import fit

RECORDED = Path(__file__).parent / "recorded_results"
MODELS_FILE = RECORDED / "final_models.pt"
MACHINE_FILE = RECORDED / "recorded_on.json"
TOLERANCE = 1e-6
"""Largest difference allowed from a recorded value off the recording's machine: 17 times the 6.0e-8
measured across kernels and threads, and a tenth of what a server step 0.01% too long changes."""

DATA = DataArgs(name="digits", partition="dirichlet", alpha=0.5, min_samples=20, augment=False)
FEDERATION = FederationArgs(rounds=3, num_clients=6, clients_per_round=4, local_steps=4, batch_size=16, eval_every=3)
MLP = ModelArgs(name="mlp", options={"hidden": 32, "depth": 1})
CONST_MLP = ModelArgs(name="mlp", bias=False, norm="none", options={"hidden": 32, "depth": 1})

CASES = {
    "fedavg": dict(algorithm=FedAvg(), model=MLP),
    "scaffold": dict(algorithm=SCAFFOLD(), model=MLP),
    "ctpfl_fused": dict(algorithm=CTPFL(span=0.2), model=MLP, compute=ComputeArgs(client_path="grouped")),
    "ctpfl_loop": dict(algorithm=CTPFL(span=0.2), model=MLP, compute=ComputeArgs(client_path="loop")),
    "moon": dict(algorithm=MOON(mu=1.0, projection_dim=8), model=MLP),
    "fedsam_const": dict(algorithm=FedSAM(rho=0.05), model=CONST_MLP, constraint=CONST()),
    "feddyn": dict(algorithm=FedDyn(alpha=0.1), model=MLP),
}

# What decides the last bits of a float32 result on the CPU, besides the code: the torch build, the
# vector kernels ATen dispatches to, and those MKL picks for matrix products (from the CPU, unless
# told otherwise).
VECTOR_FLAGS = re.compile(r"avx|amx|fma|sse|f16c|neon|asimd|sve")
MKL_VARIABLES = ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


def this_machine() -> dict:
    """What the final models' last bits depend on here."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.MULTILINE)
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "cpu": model.group(1).strip() if model else platform.processor(),
        "vector_flags": sorted(f for f in (flags.group(1).split() if flags else []) if VECTOR_FLAGS.search(f)),
        **{name.lower(): os.environ.get(name) for name in MKL_VARIABLES},
    }


def final_model(out_dir: Path, case: str, threads: int = 1) -> dict[str, torch.Tensor]:
    """The case's final model (every parameter and buffer), trained on `threads` torch threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        train(out_dir, CASES[case])
    finally:
        torch.set_num_threads(previous)
    return torch.load(out_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["model"]


def train(out_dir: Path, settings: dict) -> None:
    fit(
        algorithm=settings["algorithm"], model=settings["model"], data=DATA, federation=FEDERATION,
        client_optimizer=ClientOptimizerArgs(lr=0.05, momentum=0.9), constraint=settings.get("constraint"),
        fabric=FabricArgs(accelerator="cpu", devices=1),
        compute=settings.get("compute", ComputeArgs(client_path="loop")),
        logger=LoggerArgs(wandb_mode="disabled", progress_bar=False), checkpoint=CheckpointArgs(every=3),
        seed=0, out_dir=out_dir, resume=None,
    )


@dataclass
class Comparison:
    bitwise: bool
    largest_difference: float
    """Over every value of every tensor; inf where names, shapes or dtypes differ."""

    def describe(self) -> str:
        return "bitwise equal" if self.bitwise else f"largest difference {self.largest_difference:.3g}"


def compare(model: dict[str, torch.Tensor], recorded: dict[str, torch.Tensor]) -> Comparison:
    if model.keys() != recorded.keys() or any(
            (model[n].dtype, model[n].shape) != (recorded[n].dtype, recorded[n].shape) for n in model):
        return Comparison(bitwise=False, largest_difference=float("inf"))
    bitwise = all(torch.equal(model[name], recorded[name]) for name in model)
    largest = max(((model[n].double() - recorded[n].double()).abs().max().item() for n in model if model[n].numel()),
                  default=0.0)
    return Comparison(bitwise=bitwise, largest_difference=largest)


def recorded_models() -> dict[str, dict[str, torch.Tensor]]:
    return torch.load(MODELS_FILE, map_location="cpu", weights_only=True)


def recorded_machine() -> dict:
    return json.loads(MACHINE_FILE.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_final_model_is_the_recorded_one(case, tmp_path, record_property):
    comparison = compare(final_model(tmp_path / case, case), recorded_models()[case])
    record_property("comparison", comparison.describe())
    if this_machine() == recorded_machine():
        assert comparison.bitwise, f"{case}: {comparison.describe()} on the machine and torch build of the recording"
    else:
        assert comparison.largest_difference <= TOLERANCE, f"{case}: {comparison.describe()}, above {TOLERANCE}"


def test_the_comparison_tells_bitwise_from_close_from_different():
    recorded = {"w": torch.tensor([0.25, -0.5]), "count": torch.tensor(3)}
    assert compare({k: v.clone() for k, v in recorded.items()}, recorded) == Comparison(True, 0.0)
    nudged = {"w": torch.tensor([0.25, -0.5 + 2 ** -24]), "count": torch.tensor(3)}
    assert compare(nudged, recorded) == Comparison(False, 2 ** -24)
    assert compare({"w": recorded["w"]}, recorded).largest_difference == float("inf")
    assert compare({**recorded, "w": recorded["w"].double()}, recorded).largest_difference == float("inf")


def test_the_recording_is_of_every_case():
    assert recorded_models().keys() == CASES.keys()
    assert recorded_machine().keys() == this_machine().keys()


def uniform_aggregation(clients, sizes, weighting):
    return {client: 1.0 / len(clients) for client in clients}


def server_step_too_long(original):
    def step(self, state, params, aggregate):
        original(self, state, params, {name: value * 1.0001 for name, value in aggregate.items()})
    return step


@pytest.mark.parametrize("wrong_rule", ["uniform weights", "server step 0.01% too long"])
def test_a_wrong_rule_is_far_outside_the_tolerance(wrong_rule, tmp_path, monkeypatch):
    """FedAvg weighting its clients uniformly instead of by their samples (a difference of 1.7e-2 here),
    and a server step 1.0001 times too long (1.1e-5): both are refused on any machine."""
    from fl_lightning.federation import loop

    if wrong_rule == "uniform weights":
        monkeypatch.setattr(loop, "aggregation_weights", uniform_aggregation)
    else:
        monkeypatch.setattr(FedAvg, "server_update", server_step_too_long(FedAvg.server_update))
    comparison = compare(final_model(tmp_path / "fedavg", "fedavg"), recorded_models()["fedavg"])
    assert comparison.largest_difference > 10 * TOLERANCE, comparison.describe()


# --- recording and measuring: `python tests/integration/test_bitwise_results.py record | spread` ------------------

CONDITIONS = {
    "native, 1 thread": {},
    "native, 2 threads": {"THREADS": "2"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "ATEN_CPU_CAPABILITY=default, MKL_ENABLE_INSTRUCTIONS=SSE4_2, 2 threads":
        {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "THREADS": "2"},
    "ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2": {"ATEN_CPU_CAPABILITY": "avx2",
                                                               "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def train_all(folder: Path, threads: int) -> dict[str, dict[str, torch.Tensor]]:
    return {case: final_model(folder / case, case, threads) for case in sorted(CASES)}


def spread() -> None:
    """Each condition's final models (trained in a fresh process) against the recorded ones."""
    import tempfile

    recorded = recorded_models()
    print(f"recorded on {recorded_machine()}\nhere: {this_machine()}")
    with tempfile.TemporaryDirectory() as folder:
        for condition, variables in CONDITIONS.items():
            output = Path(folder) / f"{len(os.listdir(folder))}.pt"
            environment = {**os.environ, **variables}
            subprocess.run([sys.executable, __file__, "train", str(output)], env=environment, check=True,
                           stdout=subprocess.DEVNULL)
            models = torch.load(output, weights_only=True)
            results = {case: compare(models[case], recorded[case]) for case in sorted(CASES)}
            largest = max(result.largest_difference for result in results.values())
            print(f"{condition}: largest difference {largest:.3g}; "
                  + ", ".join(f"{case} {result.describe()}" for case, result in results.items()), flush=True)
    size = max(tensor.abs().max().item() for model in recorded.values() for tensor in model.values()
               if tensor.is_floating_point())
    print(f"largest recorded weight: {size:.3g}; tolerance {TOLERANCE}")


if __name__ == "__main__":
    import tempfile

    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "spread":
        spread()
    elif command in ("record", "train"):
        with tempfile.TemporaryDirectory() as folder:
            models = train_all(Path(folder), int(os.environ.get("THREADS", "1")))
        if command == "train":
            torch.save(models, sys.argv[2])
        else:
            RECORDED.mkdir(exist_ok=True)
            torch.save(models, MODELS_FILE)
            MACHINE_FILE.write_text(json.dumps(this_machine(), indent=2) + "\n")
            print(f"recorded {sorted(models)} in {MODELS_FILE} on {this_machine()}")
    else:
        sys.exit("usage: python tests/integration/test_bitwise_results.py record | spread")
