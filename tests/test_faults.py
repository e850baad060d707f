"""Faults, end to end: `fl-lightning fit` in subprocesses that are signalled, killed, handed a
corrupt checkpoint or a diverging learning rate, and the command line's refusal of bad settings.

Runs that are interrupted must end with the same global model as an uninterrupted run.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fl_lightning.checkpoint import checkpoint_dir, load_checkpoint, numbered_checkpoints
from fl_lightning.cli import main as fl_lightning_main

REPOSITORY = Path(__file__).resolve().parents[1]
QUICKSTART = REPOSITORY / "configs" / "quickstart.yaml"
FIT = [sys.executable, "-m", "fl_lightning.cli", "fit"]
# Rounds of a few milliseconds each: enough of them that a signal sent after round 2 lands well
# before the end, while the whole run stays within seconds.
ROUNDS = 300
CHECKPOINT_EVERY = 25
TRAINING = [
    "--config", str(QUICKSTART), "--model.options", "{hidden: 32, depth: 1}", "--logger.progress_bar", "false",
    "--federation.rounds", str(ROUNDS), "--federation.clients_per_round", "3", "--federation.local_steps", "2",
    "--federation.eval_every", str(ROUNDS), "--checkpoint.every", str(CHECKPOINT_EVERY), "--checkpoint.keep", "3",
    "--resume", "auto",
]
RUN_TIMEOUT_S = 180
SLURM_JOB_ID = "4242"


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch):
    """Each test starts outside SLURM, whatever the shell running pytest has set."""
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)


def fit_command(out_dir: Path, *extra: str) -> list[str]:
    return [*FIT, *TRAINING, "--out_dir", str(out_dir), *extra]


def process_environment(**extra: str) -> dict[str, str]:
    # One thread per process: the machine may have as few cores as the ranks.
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "OMP_NUM_THREADS": "1", **extra}


def run_fit(out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(fit_command(out_dir, *extra), env=process_environment(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def completed_rows(out_dir: Path) -> list[dict]:
    """metrics.jsonl as far as written: a line still being appended is left out."""
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def last_round(out_dir: Path) -> int:
    rows = completed_rows(out_dir)
    return rows[-1]["round"] if rows else 0


def checkpoint_round(path: Path) -> int:
    return int(re.search(r"round_(\d+)\.ckpt$", path.name).group(1))


def final_model(out_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint_dir(out_dir) / "last.ckpt", map_location="cpu", weights_only=False)["model"]


def assert_same_model(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-6), f"{name} differs"


def wait_until(condition, processes: list[subprocess.Popen], what: str) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not condition():
        if any(p.poll() is not None for p in processes):
            pytest.fail(f"the run ended before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def wait_all(processes: list[subprocess.Popen]) -> list[int]:
    try:
        return [p.wait(timeout=RUN_TIMEOUT_S) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted single-process run."""
    out_dir = tmp_path_factory.mktemp("reference") / "run"
    completed = run_fit(out_dir)
    assert completed.returncode == 0, completed.stderr
    return out_dir


def test_sigkill_then_rerun_reaches_the_uninterrupted_model(reference, tmp_path):
    out_dir = tmp_path / "run"
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(fit_command(out_dir), env=process_environment(), stdout=subprocess.DEVNULL,
                                   stderr=stderr)

    def past_a_checkpoint() -> bool:
        saved = numbered_checkpoints(checkpoint_dir(out_dir))
        return bool(saved) and last_round(out_dir) > checkpoint_round(saved[-1])

    wait_until(past_a_checkpoint, [process], "a round after the first checkpoint")
    process.kill()
    assert wait_all([process]) == [-signal.SIGKILL]
    rows_before = completed_rows(out_dir)
    resumed_round = checkpoint_round(numbered_checkpoints(checkpoint_dir(out_dir))[-1])
    assert resumed_round < ROUNDS

    completed = run_fit(out_dir)
    assert completed.returncode == 0, completed.stderr
    rows = completed_rows(out_dir)
    assert [row["round"] for row in rows] == list(range(1, ROUNDS + 1))
    # Rows up to the checkpoint are kept as they were: the rerun resumed rather than restarted.
    assert rows[:resumed_round] == rows_before[:resumed_round]
    assert_same_model(final_model(out_dir), final_model(reference))


def test_corrupt_newest_checkpoint_resumes_from_the_previous_one(reference, tmp_path):
    out_dir = tmp_path / "run"
    shutil.copytree(reference, out_dir)
    *_, previous, newest = numbered_checkpoints(checkpoint_dir(out_dir))
    assert checkpoint_round(newest) == ROUNDS
    os.truncate(newest, newest.stat().st_size // 2)

    completed = run_fit(out_dir)
    assert completed.returncode == 0, completed.stderr
    assert f"checkpoint {newest} is unreadable" in completed.stderr
    assert "trying the previous checkpoint" in completed.stderr
    rows, reference_rows = completed_rows(out_dir), completed_rows(reference)
    resumed_round = checkpoint_round(previous)
    assert rows[:resumed_round] == reference_rows[:resumed_round]
    # The rounds after it were trained again (their timings are new).
    assert rows[resumed_round:] != reference_rows[resumed_round:]
    assert load_checkpoint(newest)["round"] == ROUNDS
    assert_same_model(final_model(out_dir), final_model(reference))


def test_non_finite_update_fails_naming_round_and_clients(reference, tmp_path):
    """A diverging client update (lr 1e30) in the rounds after a resume stops the run; the last
    good checkpoint stays the newest and loads."""
    out_dir = tmp_path / "run"
    shutil.copytree(reference, out_dir)

    completed = run_fit(out_dir, "--federation.rounds", str(ROUNDS + 2), "--client_optimizer.lr", "1e30")
    assert completed.returncode != 0
    assert re.search(rf"round {ROUNDS + 1}\b.*clients \[\d+(, \d+)*\].*not finite", completed.stderr), completed.stderr
    newest = numbered_checkpoints(checkpoint_dir(out_dir))[-1]
    assert checkpoint_round(newest) == ROUNDS
    assert_same_model(load_checkpoint(newest)["model"], final_model(reference))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_ranks_as_srun(out_dir: Path, bin_dir: Path, logs: Path) -> list[subprocess.Popen]:
    """Two ranks on one simulated node, each started with the variables srun gives its tasks;
    `bin_dir` (the stand-in scontrol) comes first on PATH."""
    logs.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    processes = []
    for rank in range(2):
        environment = process_environment(
            SLURM_JOB_ID=SLURM_JOB_ID, SLURM_JOB_NAME="fault-test", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2",
            SLURM_NNODES="1", SLURM_NODEID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        )
        command = fit_command(out_dir, "--fabric.accelerator", "cpu", "--fabric.devices", "2",
                              "--fabric.process_group_timeout_s", "60", "--checkpoint.every", str(10 * ROUNDS))
        with open(logs / f"rank{rank}.out", "w") as stdout, open(logs / f"rank{rank}.err", "w") as stderr:
            processes.append(subprocess.Popen(command, env=environment, stdout=stdout, stderr=stderr))
    return processes


def rank_logs(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(logs.iterdir()))


@pytest.mark.multiprocess
def test_requeue_signal_under_slurm_checkpoints_requeues_and_resumes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol_calls = tmp_path / "scontrol_calls.txt"
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {scontrol_calls}\n')
    (bin_dir / "scontrol").chmod(0o755)

    reference = tmp_path / "reference"
    assert wait_all(launch_ranks_as_srun(reference, bin_dir, tmp_path / "logs-reference")) == [0, 0], \
        rank_logs(tmp_path / "logs-reference")

    out_dir = tmp_path / "run"
    ranks = launch_ranks_as_srun(out_dir, bin_dir, tmp_path / "logs-signalled")
    wait_until(lambda: last_round(out_dir) >= 2, ranks, "round 2")
    # Only rank 1 is signalled: the ranks must still agree to stop, and rank 0 must requeue.
    ranks[1].send_signal(signal.SIGUSR1)
    assert wait_all(ranks) == [0, 0], rank_logs(tmp_path / "logs-signalled")
    stop_round = last_round(out_dir)
    assert stop_round < ROUNDS
    assert [checkpoint_round(p) for p in numbered_checkpoints(checkpoint_dir(out_dir))] == [stop_round]
    assert scontrol_calls.read_text().splitlines() == [f"requeue {SLURM_JOB_ID}"]
    rank0_output = (tmp_path / "logs-signalled" / "rank0.out").read_text()
    assert f"stop requested: checkpoint saved after round {stop_round}" in rank0_output
    assert f"requeued SLURM job {SLURM_JOB_ID}" in rank0_output
    rows_before = completed_rows(out_dir)

    assert wait_all(launch_ranks_as_srun(out_dir, bin_dir, tmp_path / "logs-requeued")) == [0, 0], \
        rank_logs(tmp_path / "logs-requeued")
    assert scontrol_calls.read_text().splitlines() == [f"requeue {SLURM_JOB_ID}"]  # no second requeue
    rows = completed_rows(out_dir)
    assert [row["round"] for row in rows] == list(range(1, ROUNDS + 1))
    assert rows[:stop_round] == rows_before[:stop_round]
    assert_same_model(final_model(out_dir), final_model(reference))


SIMULATED_SLURM_TWO_TASKS = {"SLURM_JOB_ID": SLURM_JOB_ID, "SLURM_JOB_NAME": "fault-test", "SLURM_NTASKS": "2",
                             "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"}
BAD_INPUTS = {
    "unknown algorithm": ("algorithm", ["--algorithm", "fedsomething"], {}),
    "unknown model": ("model.name", ["--model.name", "no_such_network"], {}),
    "alpha zero": ("data.alpha", ["--data.alpha", "0"], {}),
    "alpha negative": ("data.alpha", ["--data.alpha", "-0.5"], {}),
    "more clients per round than clients": ("federation.clients_per_round",
                                            ["--federation.clients_per_round", "11"], {}),
    "no clients per round": ("federation.clients_per_round", ["--federation.clients_per_round", "0"], {}),
    "local steps and epochs": ("federation.local_epochs", ["--federation.local_epochs", "1"], {}),
    "neither local steps nor epochs": ("federation.local_steps", ["--federation.local_steps", "null"], {}),
    "rounds not a number": ("federation.rounds", ["--federation.rounds", "abc"], {}),
    "missing dataset folder": ("data.root", ["--data.name", "cifar10", "--data.root", "/nonexistent"], {}),
    "out_dir under a file": ("out_dir", ["--out_dir", "{tmp}/a_file/run"], {}),
    "missing resume checkpoint": ("resume", ["--resume", "{tmp}/missing.ckpt"], {}),
    "devices unlike the SLURM allocation": ("fabric.devices", ["--fabric.devices", "1"], SIMULATED_SLURM_TWO_TASKS),
    "nodes unlike the SLURM allocation": ("fabric.num_nodes", ["--fabric.devices", "2", "--fabric.num_nodes", "2"],
                                          SIMULATED_SLURM_TWO_TASKS),
    "unknown signal": ("checkpoint.requeue_signal", ["--checkpoint.requeue_signal", "SIGNOPE"], {}),
    "momentum of one": ("client_optimizer.momentum", ["--client_optimizer.momentum", "1"], {}),
}


def bad_input_arguments(tmp_path: Path, extra: list[str]) -> list[str]:
    (tmp_path / "a_file").write_text("")
    # Tiny runs: a case that slipped through would train for a moment, not for minutes.
    return ["fit", *TRAINING, "--federation.rounds", "2", "--out_dir", str(tmp_path / "run"),
            *(argument.format(tmp=tmp_path) for argument in extra)]


def assert_refused_before_training(status, stderr: str, field_name: str, tmp_path: Path) -> None:
    assert status not in (None, 0)
    assert field_name in stderr, stderr
    # fit writes config.yaml first thing once the ranks are up.
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize("field_name, extra, environment", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_refused_naming_the_field(field_name, extra, environment, tmp_path, monkeypatch, capsys):
    """Through the same `main` the `fl-lightning` script runs, in this process to keep the table
    fast; the next test checks that a real process exits the same way."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        fl_lightning_main(bad_input_arguments(tmp_path, extra))
    assert_refused_before_training(exited.value.code, capsys.readouterr().err, field_name, tmp_path)


def test_bad_input_in_a_real_process(tmp_path):
    field_name, extra, environment = BAD_INPUTS["devices unlike the SLURM allocation"]
    completed = subprocess.run([sys.executable, "-m", "fl_lightning.cli", *bad_input_arguments(tmp_path, extra)],
                               env=process_environment(**environment), capture_output=True, text=True,
                               timeout=RUN_TIMEOUT_S)
    assert completed.returncode == 2
    assert_refused_before_training(completed.returncode, completed.stderr, field_name, tmp_path)
