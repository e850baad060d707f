"""What the tests of a sweep share: a tiny plan's settings, a run held at a known round, a sweep started as a
process of its own and waited for, and a stand-in sbatch. The fixture `gate` is the
tests' own (tests/conftest.py's pytest_plugins)."""

import os
import sys
from pathlib import Path

import holds
import processes
import pytest
import yaml
from paths import QUICKSTART, REPOSITORY

from fl_lightning.run_logging import MetricsLog

ROUNDS = 3
TINY = {"model.options": {"hidden": 16, "depth": 1}, "federation.rounds": ROUNDS, "federation.local_steps": 2,
        "checkpoint.every": 1, "logger.wandb_mode": "disabled"}
TIMEOUT_S = 120
FL_LIGHTNING_BIN = Path(sys.executable).parent
"""Where the tests' environment has its scripts, fl-lightning among them."""

# Holds a run after round 1 (its checkpoint written) while its run folder has a file `hold`, until the
# run is asked to stop: the sweep is interrupted at a known point, whatever the machine's speed.
HOLD = {"callbacks": [holds.hold_after(1)]}


@pytest.fixture
def gate(tmp_path, monkeypatch) -> None:
    """HOLD importable in the runs the sweep starts (this process has the tests' helpers on sys.path),
    with the test's folder as the working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", holds.pythonpath())


def write_plan(path: Path, methods: dict, seeds=(0, 1), settings=None, extra=()) -> Path:
    plan = {"name": "smoke", "configs": [QUICKSTART, TINY, *extra], "methods": methods,
            "settings": settings if settings is not None else {"alpha": {"0.5": [{"data.alpha": 0.5}]}},
            "seeds": list(seeds)}
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def files_of(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `folder`: relative path -> (mtime in ns, content)."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def start_sweep(tmp_path: Path, name: str, *arguments: str, fresh_runs: bool = False
                ) -> tuple[processes.Popen, Path, Path]:
    """`fl-lightning sweep ...` as a process of its own: (the process, its stdout file, its stderr file).
    Its runs are forks of the tests' forkserver, or with `fresh_runs` fresh interpreters, as the sweep
    starts them for users."""
    output, errors = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with open(output, "w") as stdout, open(errors, "w") as stderr:
        process = processes.Popen([sys.executable, "-m", "fl_lightning", "sweep", *arguments],
                                  env=processes.threaded_environment(), stdout=stdout, stderr=stderr,
                                  fork_runs=not fresh_runs)
    return process, output, errors


def finish(process: processes.Popen) -> int:
    try:
        return process.wait(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()


def jobs_find_fl_lightning(monkeypatch) -> None:
    """fl-lightning on PATH, as in a shell with the tests' environment activated: a submission checks
    that its jobs will find it (slurm/lib.sh's fl_activate), and the tests may run without it on PATH."""
    monkeypatch.delenv("FL_ACTIVATE", raising=False)
    monkeypatch.setenv("PATH", f"{FL_LIGHTNING_BIN}{os.pathsep}{os.environ['PATH']}")


def stand_in_sbatch(tmp_path: Path, monkeypatch) -> Path:
    record = tmp_path / "sbatch_args.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {record}\necho "Submitted batch job 42"\n')
    (bin_dir / "sbatch").chmod(0o755)
    jobs_find_fl_lightning(monkeypatch)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(REPOSITORY)  # jobs are submitted from the repository root
    return record


def dataset_settings(tmp_path: Path) -> dict:
    """Two datasets, neither there: CIFAR-10 with no folder, CIFAR-100 with its train file only."""
    (tmp_path / "partial" / "cifar-100-python").mkdir(parents=True)
    (tmp_path / "partial" / "cifar-100-python" / "train").write_bytes(b"")
    return {"dataset": {"cifar10": [{"data.name": "cifar10", "data.root": str(tmp_path / "nothing")}],
                        "cifar100": [{"data.name": "cifar100", "data.root": str(tmp_path / "partial")}]}}


def log_rounds(out_dir: Path, seconds: list[float]) -> None:
    """metrics.jsonl of a run that trained rounds of these round_seconds, as the run writes it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    MetricsLog(out_dir, [{"round": number, "train_loss": 1.0, "round_seconds": value}
                         for number, value in enumerate(seconds, start=1)])
