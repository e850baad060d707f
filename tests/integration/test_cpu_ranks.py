"""`fabric.devices: auto` on the CPU: one rank per core this process may use, tested as a pure function and
against the environments a rank can start in; runs check that `auto` launches that many ranks, each on
the threads the rule of tests/test_cpu.py gives, and trains the model of one rank."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from paths import QUICKSTART, SUPPORT
from recording_callbacks import RecordThreads
from reference import small_setup

from fl_lightning import cluster
from fl_lightning.algorithms import FedAvg
from fl_lightning.cluster import Ranks, check_slurm_allocation, ranks_of, resolve_ranks
from fl_lightning.commands.main import main
from fl_lightning.config import ClientOptimizerArgs, FabricArgs
from fl_lightning.errors import ConfigError
from fl_lightning.fit import fit

SLURM_TWO_NODES_OF_FOUR = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "fl", "SLURM_NTASKS": "8",
                           "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2"}
# Variables that would tell `ranks_of` it runs in a rank some launcher started.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def recorded_threads(folder: Path) -> dict[int, set[tuple[int, int]]]:
    """Rank -> the (world size, threads) pairs it recorded."""
    return {int(path.stem.removeprefix("threads_rank")): {tuple(map(int, line.split())) for line in
                                                         path.read_text().splitlines()}
            for path in folder.glob("threads_rank*.txt")}


@pytest.fixture(autouse=True)
def outside_any_launch(monkeypatch):
    """Each test starts outside SLURM and outside any launched rank, with no OMP_NUM_THREADS, whatever
    the shell (or conftest) has set."""
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in LAUNCH_VARIABLES or name == "OMP_NUM_THREADS":
            monkeypatch.delenv(name)


# --- the rule -------------------------------------------------------------------------------------

@pytest.mark.parametrize("devices, on_cpu, cores, slurm_tasks, started_ranks, interactive, expected", [
    # auto on the CPU: a rank per core; a single core is one rank.
    ("auto", True, 2, None, None, False, 2),
    ("auto", True, 16, None, None, False, 16),
    ("auto", True, 1, None, None, False, 1),
    # A rank that a launcher started takes the launcher's number, whatever cores it sees.
    ("auto", True, 16, None, 2, False, 2),
    # Under SLURM: the allocation's tasks per node, on the CPU as on GPUs.
    ("auto", True, 16, 4, None, False, 4),
    ("auto", False, 16, 4, None, False, 4),
    # On a GPU: Fabric's own auto (every visible GPU).
    ("auto", False, 16, None, None, False, "auto"),
    ("auto", False, 16, None, 2, False, "auto"),
    # An interactive session cannot launch ranks: one.
    ("auto", True, 16, None, None, True, 1),
    # A number is kept, wherever the run is.
    (1, True, 16, None, None, False, 1),
    (3, True, 2, None, None, False, 3),
    (2, False, 16, None, None, False, 2),
    (4, True, 16, 4, None, False, 4),
])
def test_the_rule(devices, on_cpu, cores, slurm_tasks, started_ranks, interactive, expected):
    assert resolve_ranks(devices, on_cpu=on_cpu, cores=cores, slurm_tasks=slurm_tasks, started_ranks=started_ranks,
                         interactive=interactive) == Ranks(expected)


def test_auto_is_the_default():
    assert FabricArgs().devices == "auto"


@pytest.fixture
def cores(monkeypatch):
    def set_cores(count: int) -> None:
        monkeypatch.setattr(cluster, "available_cores", lambda: count)
    return set_cores


def test_auto_on_the_cpu_counts_cores_in_the_launching_process(cores, monkeypatch):
    cores(3)
    assert ranks_of(FabricArgs(accelerator="cpu")) == Ranks(3)
    # A process that launched ranks before keeps Fabric's variables; it still launches, and counts.
    for name, value in {"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert ranks_of(FabricArgs(accelerator="cpu")) == Ranks(3)


@pytest.mark.parametrize("environment, num_nodes, expected", [
    ({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}, 1, 2),  # Fabric's re-run of the command
    ({"LOCAL_RANK": "0", "NODE_RANK": "1", "WORLD_SIZE": "6"}, 2, 3),  # rank 0 of the second node
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 2, 4),  # torchrun
    ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 2, 4),
])
def test_a_started_rank_agrees_with_its_launcher_whatever_cores_it_sees(environment, num_nodes, expected, cores,
                                                                       monkeypatch):
    cores(7)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert ranks_of(FabricArgs(accelerator="cpu", num_nodes=num_nodes)) == Ranks(expected)


def test_auto_on_a_gpu_is_fabrics(cores, monkeypatch):
    cores(7)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ranks_of(FabricArgs()) == Ranks("auto")
    assert ranks_of(FabricArgs(accelerator="cpu")) == Ranks(7)


def test_under_slurm_auto_is_the_allocations_tasks_per_node(cores, monkeypatch):
    cores(7)
    for name, value in SLURM_TWO_NODES_OF_FOUR.items():
        monkeypatch.setenv(name, value)
    assert ranks_of(FabricArgs(accelerator="cpu", num_nodes=2)) == Ranks(4)
    check_slurm_allocation(FabricArgs(devices="auto", num_nodes=2))
    # The check still names what does not fit: another number, or other nodes.
    with pytest.raises(ConfigError, match="fabric.devices"):
        check_slurm_allocation(FabricArgs(devices=7, num_nodes=2))
    with pytest.raises(ConfigError, match="fabric.num_nodes"):
        check_slurm_allocation(FabricArgs(devices="auto", num_nodes=1))
    # Without --ntasks-per-node: tasks / nodes.
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")
    monkeypatch.setenv("SLURM_NTASKS", "6")
    assert ranks_of(FabricArgs(accelerator="cpu", num_nodes=2)) == Ranks(3)
    # In an interactive allocation ranks are started by hand: the cores count.
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")
    assert ranks_of(FabricArgs(accelerator="cpu")) == Ranks(7)


# --- runs -----------------------------------------------------------------------------------------

def test_omp_num_threads_leaves_torchs_threads_alone(cifar_root, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        fit(algorithm=FedAvg(), callbacks=[RecordThreads(str(tmp_path))],
            **small_setup(cifar_root, tmp_path / "run", rounds=1))
        assert recorded_threads(tmp_path) == {0: {(1, 3)}}
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("hidden, threads", [(16, 1), (16000, 3)], ids=["small model", "large model"])
def test_a_run_prints_its_choice_and_trains_on_it(hidden, threads, tmp_path, capsys, cpus):
    """In a caller's process, whose threads are put back afterwards."""
    cpus(3)
    previous = torch.get_num_threads()
    try:
        main(["fit", "--config", QUICKSTART, "--model.options", f"{{hidden: {hidden}, depth: 1}}",
              "--federation.rounds", "1", "--federation.local_steps", "1", "--logger.progress_bar", "false",
              "--config", str(record_threads_config(tmp_path)), "--out_dir", str(tmp_path / "run")])
        assert torch.get_num_threads() == previous
    finally:
        torch.set_num_threads(previous)
    assert f"torch threads: {threads} per rank (auto: " in capsys.readouterr().out
    assert recorded_threads(tmp_path) == {0: {(1, threads)}}


def record_threads_config(folder: Path) -> Path:
    config = folder / "callbacks.yaml"
    config.write_text(yaml.safe_dump({"callbacks": [{"class_path": "recording_callbacks.RecordThreads",
                                                     "init_args": {"folder": str(folder)}}]}))
    return config


TWO_CLIENTS = ["--config", QUICKSTART, "--model.options", "{hidden: 16, depth: 1}", "--federation.rounds", "3",
               "--federation.clients_per_round", "2", "--federation.local_steps", "5", "--federation.eval_every", "3",
               "--logger.progress_bar", "false"]


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_auto_runs_a_rank_per_core_on_one_thread_and_trains_the_model_of_one_rank(tmp_path):
    """The command line, as a user starts it: Fabric re-runs it for rank 1, which must agree on the
    number of ranks. Its cores are the first two this test may use, on any machine.

    Bitwise equality needs the two runs to round alike: the same torch threads (the thread count
    changes how a matrix product sums, so the one-rank run gets one thread too), and an aggregation
    whose order cannot matter: two clients of weight 1/2 (exact products, and a + b == b + a)."""
    two_cores = sorted(os.sched_getaffinity(0))[:2]
    config = record_threads_config(tmp_path)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LAUNCH_VARIABLES}
    environment.update(PYTHONPATH=os.pathsep.join([str(SUPPORT), *sys.path]))
    completed = subprocess.run(
        [sys.executable, "-m", "fl_lightning", "fit", *TWO_CLIENTS, "--federation.weighting", "uniform",
         "--config", str(config), "--fabric.devices", "auto", "--fabric.process_group_timeout_s", "120",
         "--out_dir", str(tmp_path / "auto")],
        env=environment, capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: os.sched_setaffinity(0, two_cores),
    )
    assert completed.returncode == 0, completed.stderr
    ranks = len(two_cores)
    assert recorded_threads(tmp_path) == {rank: {(ranks, 1)} for rank in range(ranks)}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        main(["fit", *TWO_CLIENTS, "--federation.weighting", "uniform", "--fabric.devices", "1",
              "--out_dir", str(tmp_path / "one")])
    finally:
        torch.set_num_threads(threads)
    auto, one = (torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=False)["model"]
                 for run in ("auto", "one"))
    assert auto.keys() == one.keys()
    assert all(torch.equal(auto[name], one[name]) for name in one), "devices auto and 1 trained different models"


@pytest.mark.multiprocess
def test_auto_trains_the_model_of_one_rank_up_to_rounding(cifar_root, tmp_path, cores):
    """Started from Python with spawned ranks; the one-rank run keeps torch's threads, and more
    clients are summed in another order on two ranks: equal up to float rounding."""
    cores(2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # not the ranks' one, so that a thread count set for them shows here
    try:
        setup = small_setup(cifar_root, tmp_path / "one", rounds=2)
        single = fit(algorithm=FedAvg(), client_optimizer=ClientOptimizerArgs(lr=0.05), **setup)
        setup.update(out_dir=tmp_path / "auto", fabric=FabricArgs(accelerator="cpu", devices="auto",
                                                                  strategy="ddp_spawn", process_group_timeout_s=120))
        auto = fit(algorithm=FedAvg(), client_optimizer=ClientOptimizerArgs(lr=0.05),
                   callbacks=[RecordThreads(str(tmp_path))], **setup)
        assert torch.get_num_threads() == 2  # the caller's threads are its own
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(auto, single, rtol=1e-5, atol=1e-6)
    assert recorded_threads(tmp_path) == {0: {(2, 1)}, 1: {(2, 1)}}
