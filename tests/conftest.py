import gc
import os
import re
import shutil
from pathlib import Path

import processes
import pytest
import quick_runs
from paths import REPOSITORY, TESTS

# Fixtures the tests of several modules share, kept beside the helpers they go with (tests/support).
pytest_plugins = ["hand_written_runs", "sweeps"]

os.environ.setdefault("WANDB_SILENT", "true")
# torch's threads in the test processes are the tests' own (`one_torch_thread`), not the rule of
# `compute.cpu_threads: auto`, which a run leaves alone when OMP_NUM_THREADS is set (its own tests
# unset it); the processes tests start take it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def uses_the_forkserver(test_file: Path) -> bool:
    """Whether a test file starts processes through tests/support/processes.py: it imports the module, or
    asks for the `forked_runs` fixture."""
    text = test_file.read_text()
    return re.search(r"^(import processes|from processes import)", text, re.MULTILINE) is not None or \
        re.search(r"def test_\w+\([^)]*\bforked_runs\b", text) is not None


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a run without it lacks
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the files that use the forkserver of tests/support/processes.py taken as one
    file: they run on one worker, so that one forkserver (about 10 CPU s of imports) serves them all
    instead of one per worker. Other modes are xdist's own."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    sharing = {path.relative_to(config.rootpath).as_posix() for path in TESTS.rglob("test_*.py")
               if uses_the_forkserver(path)}

    class ForkserverFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            test_file = super()._split_scope(nodeid)
            return "the forkserver's files" if test_file in sharing else test_file

    return ForkserverFilesTogether(config, log)


def pytest_unconfigure(config):
    """The tests are over: the interpreter's shutdown would garbage-collect, several times, every
    object their imports made (seconds that the end of `make test` waits for each worker)."""
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def forked_processes_stopped():
    """At the end of the session, the forkserver of tests/support/processes.py (if a test started it) is
    stopped and waited for: its children's CPU time then counts in pytest's, and none outlives it."""
    yield
    processes.shut_down()


@pytest.fixture
def in_repository_root(monkeypatch):
    """The repository root as the working folder: the shipped plans name their config fragments
    relative to it."""
    monkeypatch.chdir(REPOSITORY)


@pytest.fixture
def outside_slurm(monkeypatch):
    """No SLURM_* variable of the shell the tests run in reaches the test: a sweep would submit or run as a
    task, a run would take itself for a Slurm job."""
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)


@pytest.fixture
def forked_runs(monkeypatch):
    """A sweep in the test's own process starts its runs as forks (tests/support/processes.py) of the
    command line it builds, instead of fresh interpreters at 10 s of imports each. A sweep that a
    test starts as a process of its own does the same with `processes.Popen(..., fork_runs=True)`."""
    from fl_lightning.experiments.sweeps import local

    monkeypatch.setattr(local, "start_run_process", processes.start_run_process)


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory):
    """A small CIFAR-10 folder in the real python-pickle layout."""
    from fl_lightning.data.generate import write_cifar

    root = tmp_path_factory.mktemp("cifar")
    write_cifar(root, variant="cifar10", num_train=240, num_test=60, seed=0)
    return root


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """torch on one thread in the test processes (a test that needs more sets them, and sets them
    back): a small network trains several times faster on one thread than on two, and the workers
    share the machine's cores. The processes tests start take theirs from OMP_NUM_THREADS."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def reductions(monkeypatch) -> list[int]:
    """The size of every reduction across ranks a diagnostic makes (Diagnostic.sum_over_ranks), in order."""
    from fl_lightning.diagnostics.base import Diagnostic

    sizes: list[int] = []
    original = Diagnostic.sum_over_ranks

    def counted(fabric, values):
        sizes.append(values.numel())
        return original(fabric, values)

    monkeypatch.setattr(Diagnostic, "sum_over_ranks", staticmethod(counted))
    return sizes


@pytest.fixture
def wandb_reads_the_environment_afresh():
    """W&B reads the WANDB_* variables once per process, into settings it keeps until its teardown:
    they are dropped before and after the test, so that W&B reads the variables the test sets (and
    a later test not)."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A small quickstart run of quick_runs.ROUNDS rounds, trained once per test module."""
    out_dir = tmp_path_factory.mktemp("finished") / "run"
    quick_runs.fit(out_dir)
    return out_dir


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    """A copy of `finished_run` for one test to resume, damage or refuse."""
    out_dir = tmp_path / "run"
    shutil.copytree(finished_run, out_dir)
    return out_dir


@pytest.fixture
def cpus(monkeypatch):
    """The CPUs this process may use, and its cgroup's quota (None: none)."""
    from fl_lightning import cpu

    def set_cpus(count: int, quota=None) -> None:
        monkeypatch.setattr(cpu, "available_cores", lambda: count)
        monkeypatch.setattr(cpu, "cgroup_cpu_quota", lambda: quota)
    return set_cpus
