"""The throughput benchmark runs end to end (every method, its table and its JSON), its fl-lightning
FedAvg path computes the same round as its naive one-model-copy-per-client reference, so the speed
comparison is like for like, and its FedAvgM and MOON rounds are the ones `fit` trains."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch
from lightning.fabric import Fabric
from paths import REPOSITORY

from fl_lightning.config import ComputeArgs, FabricArgs, LoggerArgs
from fl_lightning.fit import fit
from fl_lightning.flat import FlatLayout

SCRIPT = REPOSITORY / "benchmarks" / "throughput.py"


@pytest.fixture(scope="module")
def throughput():
    spec = importlib.util.spec_from_file_location("throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--model", "linear", "--clients", "2", "--local-steps", "2", "--batch-size", "8", "--repeats", "1"]


@pytest.mark.slow
def test_prints_every_method_with_a_positive_rate(throughput, capsys):
    medians = throughput.main([*TINY, "--algorithms", "fedavg,ctpfl"])
    printed = capsys.readouterr().out
    methods = [throughput.CENTRALISED, throughput.NAIVE_FEDERATED,
               *(throughput.fl_lightning_name(algorithm, path)
                 for algorithm in ("fedavg", "ctpfl") for path in ("loop", "grouped"))]
    assert list(medians) == methods
    for method in methods:
        row = re.search(rf"^{re.escape(method)}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)$",
                        printed, re.MULTILINE)
        assert row is not None, f"no row for {method!r} in:\n{printed}"
        *rates, outside_clients = row.groups()
        assert all(float(value) > 0 for value in rates)
        if method.startswith("fl-lightning"):
            assert outside_clients.endswith("%") and 0 <= float(outside_clients[:-1]) < 100
        else:
            assert outside_clients == "-"
    assert "2 clients x 2 local steps x batch 8 = 32 client-samples per round" in printed
    assert "centralised: 2 steps of batch 16" in printed
    assert "precision 32-true" in printed


@pytest.mark.slow
def test_json_holds_every_setting_and_method(throughput, tmp_path, capsys):
    path = tmp_path / "out" / "throughput.json"
    throughput.main([*TINY, "--channels", "1", "--image-size", "8", "--num-classes", "5", "--channels-last",
                     "--json", str(path)])
    assert f"wrote {path}" in capsys.readouterr().out
    report = json.loads(path.read_text())
    settings = report["settings"]
    assert settings["algorithms"] == ["fedavg", "scaffold", "fedprox", "ctpfl"]
    assert (settings["channels"], settings["image_size"], settings["num_classes"]) == (1, 8, 5)
    assert settings["channels_last"] is True and settings["precision"] == "32-true"
    assert settings["client_samples_per_round"] == 32 and settings["centralised_batch_size"] == 16
    assert settings["torch"] == torch.__version__ and settings["device"] == "cpu"
    expected = [throughput.CENTRALISED, throughput.NAIVE_FEDERATED,
                *(throughput.fl_lightning_name(algorithm, path)
                  for algorithm in ("fedavg", "scaffold", "fedprox", "ctpfl") for path in ("loop", "grouped"))]
    assert [row["method"] for row in report["results"]] == expected
    assert report["errors"] == {}
    for row in report["results"]:
        assert row["samples_per_second"] > 0 and len(row["round_seconds"]) == 1, row
        assert row["vs_centralised"] > 0 and row["vs_naive_loop"] > 0, row
        assert row["peak_memory_bytes"] is None  # CUDA only
        if row["method"].startswith("fl-lightning"):
            assert 0 <= row["outside_clients"] < 1, row
        else:
            assert row["outside_clients"] is None


def test_algorithms_option_refuses_unknown_names(throughput):
    with pytest.raises(SystemExit):
        throughput.parse_args(["--algorithms", "fedavg,fedsgd"])


# resnet18 adds BatchNorm statistics to the average. It takes one local step: its local SGD steps
# differ in the last bit (torch.optim.SGD computes p - lr * g in one rounding, LocalSGD in two), and
# BatchNorm on random images amplifies that difference into the next step's gradient.
@pytest.mark.parametrize(("model_name", "local_steps"),
                         [("linear", 2), ("lenet5", 2), pytest.param("resnet18", 1, marks=pytest.mark.slow)])
def test_fedavg_round_matches_the_naive_loop(throughput, model_name, local_steps):
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    workload = throughput.Workload(num_clients=2, local_steps=local_steps, batch_size=8, device=fabric.device)
    methods = {method.name: method for method in throughput.build_methods(fabric, model_name, workload, ["fedavg"])}
    naive = methods[throughput.NAIVE_FEDERATED]
    fedavg = methods[throughput.fl_lightning_name("fedavg", "loop")]
    initial = {name: tensor.clone() for name, tensor in naive.global_model.state_dict().items()}

    naive.run_round(0)
    fedavg.run_round(0)

    expected = naive.global_model.state_dict()
    actual = fedavg.module.network.state_dict()
    floating = [name for name, tensor in expected.items() if tensor.is_floating_point()]
    for name in floating:
        torch.testing.assert_close(actual[name], expected[name], msg=f"{model_name}: {name} differs")
    # Both moved away from the shared start, so the match is not two untouched copies.
    assert any(not torch.equal(expected[name], initial[name]) for name in floating)


@pytest.mark.parametrize("algorithm", ["fedavgm", "moon"])
def test_benchmark_rounds_are_the_rounds_fit_trains(throughput, algorithm, tmp_path, monkeypatch):
    """Two rounds of the benchmark's FedAvgM (its server momentum acts from the second) and MOON (its
    projection head, its contrastive term from the second round) give bitwise the model that `fit`
    trains with the benchmark's settings on the benchmark's images."""
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    workload = throughput.Workload(num_clients=2, local_steps=2, batch_size=8, device=fabric.device, channels=1,
                                   image_size=8)
    compute = ComputeArgs(client_path="loop")
    # fit reads the benchmark's images as a dataset of the user's (data.name: module.function).
    loader = types.ModuleType("benchmark_images")
    loader.load = lambda root, download: (workload.dataset, workload.dataset)
    monkeypatch.setitem(sys.modules, loader.__name__, loader)
    settings = throughput.run_settings("mlp", workload, algorithm, compute)
    benchmark = throughput.FlLightning(fabric, "mlp", workload, algorithm, compute)
    for round_index in range(2):
        benchmark.run_round(round_index)
    trained = fit(
        algorithm=settings.algorithm, model=settings.model,
        data=dataclasses.replace(settings.data, name="benchmark_images.load"),
        federation=dataclasses.replace(settings.federation, rounds=2), client_optimizer=settings.client_optimizer,
        server_optimizer=settings.server_optimizer, fabric=FabricArgs(accelerator="cpu", devices=1),
        compute=compute, logger=LoggerArgs(progress_bar=False), seed=settings.seed, out_dir=tmp_path / "run",
        resume=None,
    )
    module = benchmark.loop.module
    assert torch.equal(FlatLayout.of(module.named_parameters()).flatten(dict(module.named_parameters())), trained)


@pytest.mark.slow
def test_gpu_check_script_runs_tiny_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.sh with its settings overridden: one small shape, one algorithm, CPU."""
    out = tmp_path / "check.json"
    environment = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_DEVICE": "cpu",
                   "GPU_CHECK_PRECISION": "32-true", "GPU_CHECK_CLIENTS": "2", "GPU_CHECK_STEPS": "1",
                   "GPU_CHECK_BATCH": "4", "GPU_CHECK_REPEATS": "1", "GPU_CHECK_ALGORITHMS": "fedavg",
                   "GPU_CHECK_SHAPES": "linear:10", "GPU_CHECK_JSON": str(out)}
    finished = subprocess.run(["bash", str(SCRIPT.with_name("gpu_check.sh"))], env=environment, capture_output=True,
                              text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "summary (cpu" in finished.stdout
    report = json.loads(out.read_text())
    assert report["failed"] == [] and report["settings"]["device"] == "cpu"
    (shape,) = report["shapes"]
    assert shape["model"] == "linear" and shape["exit_status"] == 0
    assert len(shape["results"]) == 4 and all(row["samples_per_second"] > 0 for row in shape["results"])


def test_host_sync_count_refuses_a_machine_without_cuda(capsys):
    spec = importlib.util.spec_from_file_location("host_syncs", SCRIPT.with_name("host_syncs.py"))
    host_syncs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_syncs)
    if torch.cuda.is_available():
        pytest.skip("counts on CUDA instead")
    assert host_syncs.main(["--clients", "2"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_resolve_benchmark_prints_its_three_figures(capsys, monkeypatch):
    monkeypatch.chdir(SCRIPT.parents[1])  # the plan names its fragments from the repository root
    spec = importlib.util.spec_from_file_location("resolve_benchmark", SCRIPT.with_name("resolve.py"))
    resolve_benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resolve_benchmark)
    resolve_benchmark.main(["--plan", "configs/plans/smoke.yaml", "--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"parse of `fit .*` \(median of 2\): \d+ ms by its command's parser, \d+ ms by the whole "
                        r"parser", lines[0]), lines[0]
    assert re.fullmatch(r"resolving the 12 points of configs/plans/smoke.yaml: [\d.]+ CPU s", lines[1]), lines[1]
    assert re.fullmatch(r"table of configs/plans/smoke.yaml without runs: [\d.]+ CPU s", lines[2]), lines[2]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_thread_benchmark_times_a_candidate_quiet_and_beside_busy_loops(tmp_path, monkeypatch, capsys):
    """Two runs of the quickstart on one thread, one of them beside a busy loop, as fresh processes."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = importlib.util.spec_from_file_location("cpu_threads", SCRIPT.with_name("cpu_threads.py"))
    cpu_threads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_threads)
    results = cpu_threads.main(["--workloads", "quickstart", "--candidates", "1 thread", "--busy", "1",
                                "--rounds", "2", "--json", str(tmp_path / "threads.json")])
    assert [(r["candidate"], r["busy_loops"]) for r in results] == [("1 thread", 0), ("1 thread", 1)]
    assert all(r["seconds_per_round"] > 0 and r["threads_printed"].startswith("1 per rank") for r in results)
    assert re.search(r"^quickstart\s+1 thread\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+1$", capsys.readouterr().out, re.M)
    assert json.loads((tmp_path / "threads.json").read_text())["results"] == results


@pytest.mark.slow
@pytest.mark.multiprocess
def test_client_state_benchmark_prints_memory_time_and_checkpoint_bytes_with_the_store_off_and_on(tmp_path, capsys):
    """A tiny federation, every state past the bound (0 MiB), each configuration as a fresh process."""
    spec = importlib.util.spec_from_file_location("client_state", SCRIPT.with_name("client_state.py"))
    client_state = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client_state)
    results = client_state.main(["--clients", "40", "--rounds", "4", "--checkpoint-every", "2", "--algorithms",
                                 "scaffold", "--bound-mib", "0", "--json", str(tmp_path / "client_state.json")])
    assert [(r["algorithm"], r["clients"], r["store"]) for r in results] == [("scaffold", 40, "off"),
                                                                           ("scaffold", 40, "on")]
    off, on = results
    assert all(r["peak_rss_mib"] >= r["set_up_rss_mib"] > 0 and r["seconds_per_round"] > 0 for r in results)
    assert off["between_checkpoints_bytes"] == 0 < on["between_checkpoints_bytes"]  # on: states past the bound
    assert on["states_in_memory"] == 1 < off["states_in_memory"]
    assert 0 < on["checkpoint_bytes"] < off["checkpoint_bytes"]  # on: most states written before the checkpoint
    printed = capsys.readouterr().out
    for store in ("off", "on"):
        assert re.search(rf"^scaffold\s+40 {store}\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", printed,
                         re.M), printed
    assert json.loads((tmp_path / "client_state.json").read_text()) == results


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_writes_the_same_bytes_whatever_the_clients_of_the_federation(tmp_path):
    """The same clients a round at 50 and 5,000 clients: what a checkpoint writes (its main file, index
    deltas and the states of the clients that trained) is the same, where every client's version (4
    bytes a client) or sample indices in it would add tens of kB at 5,000."""
    spec = importlib.util.spec_from_file_location("client_state", SCRIPT.with_name("client_state.py"))
    client_state = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client_state)
    small, large = client_state.main(["--clients", "50", "5000", "--clients-per-round", "10", "--rounds", "2",
                                      "--checkpoint-every", "1", "--algorithms", "scaffold", "--stores", "on"])
    assert small["checkpoint_bytes"] > 0
    assert abs(large["checkpoint_bytes"] - small["checkpoint_bytes"]) < 1024, (small, large)
