"""`fabric.devices: auto` on the CPU: one rank per core this process may use; and each CPU rank's
torch threads (`compute.cpu_threads`, fl_lightning/cpu.py).

The rules are tested as pure functions and against the environments a rank can start in; runs
check that `auto` launches that many ranks, each on the threads the rule gives, and trains the model
of one rank.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from reference import small_setup

from fl_lightning import cluster, cpu
from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import Callback
from fl_lightning.cluster import Ranks, check_slurm_allocation, ranks_of, resolve_ranks
from fl_lightning.commands.main import main
from fl_lightning.config import ClientOptimizerArgs, FabricArgs
from fl_lightning.cpu import (
    ThreadChoice,
    available_cores,
    cgroup_cpu_quota,
    choose_threads,
    cpu_rank,
    passive_wait_by_default,
)
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


# --- each rank's threads ---------------------------------------------------------------------------

SMALL, LARGE = cpu.SMALL_MODEL_PARAMETERS - 1, cpu.SMALL_MODEL_PARAMETERS


@pytest.fixture
def cpus(monkeypatch):
    """The CPUs this process may use, and its cgroup's quota (None: none)."""
    def set_cpus(count: int, quota=None) -> None:
        monkeypatch.setattr(cpu, "available_cores", lambda: count)
        monkeypatch.setattr(cpu, "cgroup_cpu_quota", lambda: quota)
    return set_cpus


def test_a_small_model_trains_on_one_thread_per_rank(cpus):
    cpus(16)
    choice = choose_threads("auto", SMALL, ranks_per_node=1, environment={})
    assert choice.threads == 1
    assert choice.describe() == ("torch threads: 1 per rank (auto: a model of 999,999 parameters trains fastest on "
                                 "one thread; more ranks use more CPUs)")


@pytest.mark.parametrize("cores, quota, ranks, environment, threads, source", [
    (8, None, 1, {}, 8, "the 8 CPUs of this process's affinity"),
    (8, None, 3, {}, 2, "the 8 CPUs of this process's affinity, over 3 ranks"),
    (2, None, 4, {}, 1, "the 2 CPUs of this process's affinity, over 4 ranks"),
    (8, 2.5, 1, {}, 2, "its cgroup's CPU quota of 2.5 CPUs"),
    (8, 0.5, 1, {}, 1, "its cgroup's CPU quota of 0.5 CPUs"),
    (8, 16.0, 2, {}, 4, "the 8 CPUs of this process's affinity, over 2 ranks"),
    # A Slurm task's own CPUs (its ranks are tasks of their own), never more than it may run on.
    (64, None, 4, {"SLURM_CPUS_PER_TASK": "6"}, 6, "SLURM_CPUS_PER_TASK=6"),
    (4, None, 4, {"SLURM_CPUS_PER_TASK": "6"}, 4, "SLURM_CPUS_PER_TASK=6"),
])
def test_a_larger_model_trains_on_the_cpus_of_its_rank(cpus, cores, quota, ranks, environment, threads, source):
    cpus(cores, quota)
    assert choose_threads("auto", LARGE, ranks_per_node=ranks, environment=environment) == \
        ThreadChoice(threads, f"auto: {source}")


def test_omp_num_threads_and_the_setting_take_precedence():
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert choose_threads("auto", SMALL, 1, {"OMP_NUM_THREADS": "3"}) == ThreadChoice(3, "OMP_NUM_THREADS=3")
    finally:
        torch.set_num_threads(previous)
    assert choose_threads(5, LARGE, 2, {"OMP_NUM_THREADS": "3"}) == ThreadChoice(5, "compute.cpu_threads")


def test_the_cgroup_quota_is_the_smallest_along_the_path(tmp_path):
    membership = tmp_path / "cgroup"
    root = tmp_path / "fs"
    (root / "job" / "step").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "job" / "cpu.max").write_text("150000 100000\n")
    (root / "job" / "step" / "cpu.max").write_text("max 100000\n")
    membership.write_text("0::/job/step\n")
    assert cgroup_cpu_quota(root, membership) == 1.5
    (root / "job" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(root, membership) is None
    # cgroup v1: the cpu controller's quota of the process's cgroup.
    (root / "cpu" / "job").mkdir(parents=True)
    (root / "cpu" / "job" / "cpu.cfs_quota_us").write_text("300000\n")
    (root / "cpu" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    membership.write_text("4:memory:/job\n1:cpu,cpuacct:/job\n")
    assert cgroup_cpu_quota(root, membership) == 3.0
    assert cgroup_cpu_quota(root, tmp_path / "no such file") is None


def test_waiting_threads_sleep_unless_threads_or_a_policy_were_chosen():
    for environment, policy in [({}, "PASSIVE"), ({"OMP_NUM_THREADS": "4"}, None),
                                ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE")]:
        passive_wait_by_default(environment)
        assert environment.get("OMP_WAIT_POLICY") == policy


def test_bf16_attention_takes_the_math_kernel_on_a_cpu_without_avx512(monkeypatch):
    """torch's fused bf16 attention on the CPU fails without AVX-512 (fl_lightning.cpu.cpu_rank)."""
    choice = ThreadChoice(1, "test")
    for capability, precision, flash in [("AVX2", "bf16-mixed", False), ("DEFAULT", "bf16-true", False),
                                         ("AVX512", "bf16-mixed", True), ("AVX2", "32-true", True)]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        with cpu_rank(choice, precision):
            assert torch.backends.cuda.flash_sdp_enabled() is flash, (capability, precision)
        assert torch.backends.cuda.flash_sdp_enabled()


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
    config.write_text(yaml.safe_dump({"callbacks": [{"class_path": "test_cpu_ranks.RecordThreads",
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
    environment.update(PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
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
