"""`fabric.devices: auto` on the CPU: one rank per core this process may use, one torch thread each.

The rule is tested as a pure function and against the environments a rank can start in; two runs
check that it launches that many ranks on one thread and trains the model of one rank.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from reference import small_setup

from fl_lightning import cluster
from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import Callback
from fl_lightning.cli.main import main
from fl_lightning.cluster import Ranks, available_cores, check_slurm_allocation, ranks_of, resolve_ranks
from fl_lightning.config import ClientOptimizerArgs, FabricArgs
from fl_lightning.errors import ConfigError
from fl_lightning.fit import fit

TESTS = Path(__file__).parent
QUICKSTART = str(TESTS.parent / "configs" / "quickstart.yaml")
SLURM_TWO_NODES_OF_FOUR = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "fl", "SLURM_NTASKS": "8",
                           "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2"}
# Variables that would tell `ranks_of` it runs in a rank some launcher started.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


class RecordThreads(Callback):
    """Appends `<world size> <torch threads>` at each round's start to <folder>/threads_rank<r>.txt."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_round_start(self, fabric, loop, round_index: int) -> None:
        with open(Path(self.folder) / f"threads_rank{fabric.global_rank}.txt", "a") as f:
            f.write(f"{fabric.world_size} {torch.get_num_threads()}\n")


def recorded_threads(folder: Path) -> dict[int, set[tuple[int, int]]]:
    """Rank -> the (world size, threads) pairs it recorded."""
    return {int(path.stem.removeprefix("threads_rank")): {tuple(map(int, line.split())) for line in
                                                         path.read_text().splitlines()}
            for path in folder.glob("threads_rank*.txt")}


@pytest.fixture(autouse=True)
def outside_any_launch(monkeypatch):
    """Each test starts outside SLURM and outside any launched rank, whatever the shell has set."""
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in LAUNCH_VARIABLES:
            monkeypatch.delenv(name)


# --- the rule -------------------------------------------------------------------------------------

@pytest.mark.parametrize("devices, on_cpu, cores, slurm_tasks, started_ranks, interactive, expected", [
    # auto on the CPU: a rank per core, one thread each; a single core is one rank.
    ("auto", True, 2, None, None, False, Ranks(2, one_thread=True)),
    ("auto", True, 16, None, None, False, Ranks(16, one_thread=True)),
    ("auto", True, 1, None, None, False, Ranks(1, one_thread=True)),
    # A rank that a launcher started takes the launcher's number, whatever cores it sees.
    ("auto", True, 16, None, 2, False, Ranks(2, one_thread=True)),
    # Under SLURM: the allocation's tasks per node, on the CPU as on GPUs; --cpus-per-task sets threads.
    ("auto", True, 16, 4, None, False, Ranks(4, one_thread=False)),
    ("auto", False, 16, 4, None, False, Ranks(4, one_thread=False)),
    # On a GPU: Fabric's own auto (every visible GPU).
    ("auto", False, 16, None, None, False, Ranks("auto", one_thread=False)),
    ("auto", False, 16, None, 2, False, Ranks("auto", one_thread=False)),
    # An interactive session cannot launch ranks: one, on torch's threads.
    ("auto", True, 16, None, None, True, Ranks(1, one_thread=False)),
    # A number is kept, threads untouched, wherever the run is.
    (1, True, 16, None, None, False, Ranks(1, one_thread=False)),
    (3, True, 2, None, None, False, Ranks(3, one_thread=False)),
    (2, False, 16, None, None, False, Ranks(2, one_thread=False)),
    (4, True, 16, 4, None, False, Ranks(4, one_thread=False)),
])
def test_the_rule(devices, on_cpu, cores, slurm_tasks, started_ranks, interactive, expected):
    assert resolve_ranks(devices, on_cpu=on_cpu, cores=cores, slurm_tasks=slurm_tasks, started_ranks=started_ranks,
                         interactive=interactive) == expected


def test_auto_is_the_default():
    assert FabricArgs().devices == "auto"


def test_cores_are_the_ones_this_process_may_run_on(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert available_cores() == 3
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert available_cores() == 64


@pytest.fixture
def cores(monkeypatch):
    def set_cores(count: int) -> None:
        monkeypatch.setattr(cluster, "available_cores", lambda: count)
    return set_cores


def test_auto_on_the_cpu_counts_cores_in_the_launching_process(cores, monkeypatch):
    cores(3)
    assert ranks_of(FabricArgs(accelerator="cpu")) == Ranks(3, one_thread=True)
    # A process that launched ranks before keeps Fabric's variables; it still launches, and counts.
    for name, value in {"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert ranks_of(FabricArgs(accelerator="cpu")) == Ranks(3, one_thread=True)


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
    assert ranks_of(FabricArgs(accelerator="cpu", num_nodes=num_nodes)) == Ranks(expected, one_thread=True)


def test_auto_on_a_gpu_is_fabrics(cores, monkeypatch):
    cores(7)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ranks_of(FabricArgs()) == Ranks("auto", one_thread=False)
    assert ranks_of(FabricArgs(accelerator="cpu")) == Ranks(7, one_thread=True)


def test_under_slurm_auto_is_the_allocations_tasks_per_node(cores, monkeypatch):
    cores(7)
    for name, value in SLURM_TWO_NODES_OF_FOUR.items():
        monkeypatch.setenv(name, value)
    assert ranks_of(FabricArgs(accelerator="cpu", num_nodes=2)) == Ranks(4, one_thread=False)
    check_slurm_allocation(FabricArgs(devices="auto", num_nodes=2))
    # The check still names what does not fit: another number, or other nodes.
    with pytest.raises(ConfigError, match="fabric.devices"):
        check_slurm_allocation(FabricArgs(devices=7, num_nodes=2))
    with pytest.raises(ConfigError, match="fabric.num_nodes"):
        check_slurm_allocation(FabricArgs(devices="auto", num_nodes=1))
    # Without --ntasks-per-node: tasks / nodes.
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")
    monkeypatch.setenv("SLURM_NTASKS", "6")
    assert ranks_of(FabricArgs(accelerator="cpu", num_nodes=2)) == Ranks(3, one_thread=False)
    # In an interactive allocation ranks are started by hand: the cores count.
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")
    assert ranks_of(FabricArgs(accelerator="cpu")) == Ranks(7, one_thread=True)


# --- runs -----------------------------------------------------------------------------------------

def test_a_number_of_devices_leaves_torchs_threads_alone(cifar_root, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        fit(algorithm=FedAvg(), callbacks=[RecordThreads(str(tmp_path))],
            **small_setup(cifar_root, tmp_path / "run", rounds=1))
        assert recorded_threads(tmp_path) == {0: {(1, 3)}}
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


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
    config = tmp_path / "callbacks.yaml"
    config.write_text(yaml.safe_dump({"callbacks": [{"class_path": "test_cpu_ranks.RecordThreads",
                                                     "init_args": {"folder": str(tmp_path)}}]}))
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LAUNCH_VARIABLES}
    # Two threads unless the rule sets one.
    environment.update(OMP_NUM_THREADS="2", PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
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
