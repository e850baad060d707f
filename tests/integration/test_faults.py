"""Faults, end to end: `fl-lightning fit` in processes that are signalled, killed, handed a
corrupt checkpoint or a diverging learning rate, and the command line's refusal of bad settings.

Runs that are interrupted must end with the same global model as an uninterrupted run. The processes
are forks of a server that has imported fl_lightning once (tests/support/processes.py), except where the
real start-up is what is tested: a signal while the interpreter imports, a bad input.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import holds
import processes
import pytest
import torch
from fault_runs import (
    FIT,
    HELD_ROUND,
    HELD_RUN_ROUNDS,
    ROUNDS,
    RUN_TIMEOUT_S,
    SLURM_JOB_ID,
    TRAINING,
    fit_command,
    held_run_arguments,
    process_environment,
    wait_all,
)
from paths import QUICKSTART

from fl_lightning.checkpoint import checkpoint_dir, client_index_path, load_checkpoint, numbered_checkpoints
from fl_lightning.commands.main import main
from fl_lightning.metric_names import COST_CLIENT_SECONDS, COST_COUNTERS, PARTICIPATION_METRICS

# Every test runs fl-lightning in other processes, each starting outside SLURM whatever the shell has set.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("outside_slurm")]
# Rounds of a few milliseconds each, and checkpoints far enough apart for a kill between two of them.


def run_fit(out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return processes.run(fit_command(out_dir, *extra), env=process_environment(), timeout=RUN_TIMEOUT_S)


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


def spent(row: dict) -> dict:
    """A metrics row's cost counters, but the seconds, which no two runs share."""
    return {key: row[key] for key in COST_COUNTERS if key != COST_CLIENT_SECONDS}


def assert_same_model(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-6), f"{name} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted single-process run."""
    out_dir = tmp_path_factory.mktemp("reference") / "run"
    completed = run_fit(out_dir)
    assert completed.returncode == 0, completed.stderr
    return out_dir


def test_sigkill_then_rerun_reaches_the_uninterrupted_model(reference, tmp_path):
    out_dir = tmp_path / "run"
    # Killed between two checkpoints (every 10 rounds), after round 25's row was written.
    # A launched process has its own process group, which the driver kills whole.
    killed = processes.run(
        [sys.executable, "-c", KILL_DRIVER, "metrics", "after", "25", "fit", *TRAINING, "--out_dir", str(out_dir)],
        env=process_environment(), timeout=RUN_TIMEOUT_S,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    rows_before = completed_rows(out_dir)
    resumed_round = checkpoint_round(numbered_checkpoints(checkpoint_dir(out_dir))[-1])
    assert resumed_round == 20

    completed = run_fit(out_dir)
    assert completed.returncode == 0, completed.stderr
    rows = completed_rows(out_dir)
    assert [row["round"] for row in rows] == list(range(1, ROUNDS + 1))
    # Rows up to the checkpoint are kept as they were: the rerun resumed rather than restarted.
    assert rows[:resumed_round] == rows_before[:resumed_round]
    assert_same_model(final_model(out_dir), final_model(reference))
    assert spent(rows[-1]) == spent(completed_rows(reference)[-1])


# SCAFFOLD, whose control variates a client keeps across the rounds it sits out, with two cyclic groups online
# in turn and a third of the uploads lost.
PARTICIPATING = ["--algorithm", "scaffold", "--federation.participation", "cyclic",
                 "--federation.participation.groups", "2", "--federation.dropout", "0.3"]


def test_sigkill_under_cyclic_participation_with_lost_uploads_resumes_to_the_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    completed = run_fit(reference, *PARTICIPATING)
    assert completed.returncode == 0, completed.stderr
    out_dir = tmp_path / "run"
    killed = processes.run(
        [sys.executable, "-c", KILL_DRIVER, "metrics", "after", "25", "fit", *TRAINING, *PARTICIPATING,
         "--out_dir", str(out_dir)], env=process_environment(), timeout=RUN_TIMEOUT_S)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    completed = run_fit(out_dir, *PARTICIPATING)
    assert completed.returncode == 0, completed.stderr
    rows, expected = completed_rows(out_dir), completed_rows(reference)
    assert [row["round"] for row in rows] == list(range(1, ROUNDS + 1))
    # Who was online, drawn, reported and dropped, round by round, as in the run never killed.
    assert [{key: row[key] for key in PARTICIPATION_METRICS} for row in rows] == [
        {key: row[key] for key in PARTICIPATION_METRICS} for row in expected]
    assert any(row["clients_dropped"] for row in rows)
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


@pytest.mark.parametrize("settings, what", [
    (["--client_optimizer.lr", "1e30"], "the aggregated update of clients"),
    # A finite update that the server step overflows: the model itself must be checked.
    (["--federation.local_steps", "1", "--client_optimizer.lr", "1e20", "--server_optimizer.lr", "1e30"],
     "the global model after the server step of clients"),
])
def test_non_finite_round_fails_naming_round_and_clients_and_saves_nothing(settings, what, tmp_path):
    out_dir = tmp_path / "run"
    completed = run_fit(out_dir, *settings, "--checkpoint.every", "1")
    assert completed.returncode == 1
    assert re.search(rf"round 1\b: {what} \[\d+(, \d+)*\] is not finite", completed.stderr), completed.stderr
    assert "no checkpoint was saved yet" in completed.stderr
    assert list(checkpoint_dir(out_dir).glob("*.ckpt")) == []
    assert "Traceback" not in completed.stderr


def launch_ranks_as_srun(out_dir: Path, bin_dir: Path, logs: Path, nodes: int = 1, *extra: str
                         ) -> list[processes.Popen]:
    """Two ranks, on one simulated node or one on each of two, each started with the variables srun
    gives its tasks; `bin_dir` (the stand-in scontrol) comes first on PATH. They train HELD_RUN_ROUNDS
    rounds, held after HELD_ROUND while `out_dir` has a file `hold`."""
    logs.mkdir(parents=True, exist_ok=True)
    port = str(processes.free_port())
    ranks = []
    for rank in range(2):
        environment = process_environment(
            SLURM_JOB_ID=SLURM_JOB_ID, SLURM_JOB_NAME="fault-test", SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE=str(2 // nodes), SLURM_NNODES=str(nodes), SLURM_NODEID=str(rank * nodes // 2),
            SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % (2 // nodes)), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=holds.pythonpath(),
        )
        command = fit_command(out_dir, "--fabric.accelerator", "cpu", "--fabric.devices", str(2 // nodes),
                              "--fabric.num_nodes", str(nodes), "--fabric.process_group_timeout_s", "60",
                              *held_run_arguments(), *extra)
        with open(logs / f"rank{rank}.out", "w") as stdout, open(logs / f"rank{rank}.err", "w") as stderr:
            ranks.append(processes.Popen(command, env=environment, stdout=stdout, stderr=stderr))
    return ranks


def requeue_calls(calls: Path) -> list[str]:
    return [line for line in calls.read_text().splitlines() if line.startswith("requeue")]


def rank_logs(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(logs.iterdir()))


def stand_in_scontrol(bin_dir: Path, calls: Path, job_state: str) -> None:
    """`scontrol show job` reports `job_state`; every other call is appended to `calls`."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\n'
        f'if [[ "$1" == show ]]; then echo "JobId=$4 JobState={job_state}"; exit 0; fi\n'
        f'echo "$@" >> {calls}\n'
    )
    (bin_dir / "scontrol").chmod(0o755)


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("two-rank-reference")
    stand_in_scontrol(folder / "bin", folder / "calls.txt", "RUNNING")
    ranks = launch_ranks_as_srun(folder / "run", folder / "bin", folder / "logs")
    assert wait_all(ranks) == [0, 0], rank_logs(folder / "logs")
    return folder / "run"


STOPS = {
    # sbatch --signal=USR1@T ahead of the time limit, seen by one rank first: the ranks still agree.
    "requeue signal to one rank": (signal.SIGUSR1, [1]),
    # Preemption with a grace time: SIGTERM to every rank while the job is still RUNNING.
    "preemption SIGTERM to every rank": (signal.SIGTERM, [0, 1]),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum, signalled_ranks", STOPS.values(), ids=STOPS.keys())
def test_stop_under_slurm_checkpoints_requeues_and_resumes(signum, signalled_ranks, two_rank_reference, tmp_path):
    bin_dir, scontrol_calls = tmp_path / "bin", tmp_path / "scontrol_calls.txt"
    stand_in_scontrol(bin_dir, scontrol_calls, "RUNNING")
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "hold").touch()
    ranks = launch_ranks_as_srun(out_dir, bin_dir, tmp_path / "logs-signalled")
    processes.wait_until(lambda: all((out_dir / f"held_rank{rank}").exists() for rank in range(2)), ranks,
                         f"both ranks held after round {HELD_ROUND}", RUN_TIMEOUT_S)
    for rank in signalled_ranks:
        ranks[rank].send_signal(signum)
    (out_dir / "hold").unlink()  # after the signal: a rank that did not get it goes on, and learns of it
    assert wait_all(ranks) == [0, 0], rank_logs(tmp_path / "logs-signalled")
    # The stop comes at the end of the round the ranks were held before.
    stop_round = HELD_ROUND + 1
    assert last_round(out_dir) == stop_round
    assert [checkpoint_round(p) for p in numbered_checkpoints(checkpoint_dir(out_dir))] == [stop_round]
    assert requeue_calls(scontrol_calls) == [f"requeue {SLURM_JOB_ID}"]
    rank0_output = (tmp_path / "logs-signalled" / "rank0.out").read_text()
    why = f"signal {signum.name}" if 0 in signalled_ranks else "requested by another rank"
    assert f"stopped ({why}; checkpoint saved) at round {stop_round}/{HELD_RUN_ROUNDS}" in rank0_output
    assert f"requeued SLURM job {SLURM_JOB_ID}" in rank0_output
    rows_before = completed_rows(out_dir)

    assert wait_all(launch_ranks_as_srun(out_dir, bin_dir, tmp_path / "logs-requeued")) == [0, 0], \
        rank_logs(tmp_path / "logs-requeued")
    assert requeue_calls(scontrol_calls) == [f"requeue {SLURM_JOB_ID}"]  # no second requeue
    rows = completed_rows(out_dir)
    assert [row["round"] for row in rows] == list(range(1, HELD_RUN_ROUNDS + 1))
    assert rows[:stop_round] == rows_before[:stop_round]
    assert_same_model(final_model(out_dir), final_model(two_rank_reference))
    assert spent(rows[-1]) == spent(completed_rows(two_rank_reference)[-1])


RANK_LOST = 75


def start_held_ranks(out_dir: Path, logs: Path, launch: str) -> list[processes.Popen]:
    """Two ranks held after HELD_ROUND (their folder has a file `hold`) with a checkpoint every round:
    on one node, started as Fabric's launcher starts them, or on two simulated Slurm nodes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "hold").touch()
    if launch == "two Slurm nodes":
        bin_dir = logs.parent / "bin"
        stand_in_scontrol(bin_dir, logs.parent / "scontrol_calls.txt", "RUNNING")
        return launch_ranks_as_srun(out_dir, bin_dir, logs, 2, "--checkpoint.every", "1")
    logs.mkdir(parents=True)
    command = fit_command(out_dir, "--fabric.accelerator", "cpu", "--fabric.devices", "2",
                          "--fabric.process_group_timeout_s", "60", *held_run_arguments(), "--checkpoint.every", "1")
    ranks = []
    for rank, environment in enumerate(processes.rank_environments(
            process_environment(PYTHONPATH=holds.pythonpath()), 2)):
        with open(logs / f"rank{rank}.out", "w") as stdout, open(logs / f"rank{rank}.err", "w") as stderr:
            ranks.append(processes.Popen(command, env=environment, stdout=stdout, stderr=stderr))
    return ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("launch, killed", [("one node", 1), ("two Slurm nodes", 0)])
def test_a_killed_rank_is_one_line_on_the_rank_left_and_the_same_command_resumes(launch, killed, two_rank_reference,
                                                                                 tmp_path):
    out_dir, logs = tmp_path / "run", tmp_path / "logs-killed"
    ranks = start_held_ranks(out_dir, logs, launch)
    processes.wait_until(lambda: all((out_dir / f"held_rank{rank}").exists() for rank in range(2)), ranks,
                         f"both ranks held after round {HELD_ROUND}", RUN_TIMEOUT_S)
    ranks[killed].send_signal(signal.SIGKILL)
    assert ranks[killed].wait(RUN_TIMEOUT_S) == -signal.SIGKILL
    (out_dir / "hold").unlink()
    left = 1 - killed
    assert wait_all(ranks)[left] == RANK_LOST, rank_logs(logs)
    stderr = (logs / f"rank{left}.err").read_text()
    gone = f"error: round {HELD_ROUND + 1}: rank {killed} (pid {ranks[killed].pid} on {socket.gethostname()}) is gone"
    resume = f"the last good checkpoint is {checkpoint_dir(out_dir) / f'round_{HELD_ROUND:06d}.ckpt'}: run the same " \
             f"command again to resume from round {HELD_ROUND}"
    peer = r"\(gloo: Connection closed by peer \[[^\]]+\]:\d+\)"
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(rf"{re.escape(gone)} {peer}; {re.escape(resume)}", errors[0]), stderr
    assert "Traceback" not in stderr and "RuntimeError" not in stderr, stderr
    saved = [checkpoint_round(path) for path in numbered_checkpoints(checkpoint_dir(out_dir))]
    assert saved == list(range(1, HELD_ROUND + 1))

    rerun = start_held_ranks(out_dir, tmp_path / "logs-rerun", launch)
    (out_dir / "hold").unlink()  # not held this time
    assert wait_all(rerun) == [0, 0], rank_logs(tmp_path / "logs-rerun")
    assert [row["round"] for row in completed_rows(out_dir)] == list(range(1, HELD_RUN_ROUNDS + 1))
    final, expected = final_model(out_dir), final_model(two_rank_reference)
    assert all(torch.equal(final[name], expected[name]) for name in expected)


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds rank 1 among rank 0's children in /proc")
def test_a_killed_rank_that_fabrics_launcher_started_is_one_line_on_rank_0(tmp_path):
    """`--fabric.devices 2` on one node: rank 0 starts rank 1 itself, and Lightning, which watches
    it, killed rank 0 as soon as it saw rank 1 gone. Rank 0 is held until that watch has seen it
    (it reaps the killed process), then goes on to the round's aggregation and names the rank."""
    out_dir, logs = tmp_path / "run", tmp_path / "logs"
    out_dir.mkdir()
    logs.mkdir()
    (out_dir / "hold").touch()
    command = fit_command(out_dir, "--fabric.accelerator", "cpu", "--fabric.devices", "2",
                          "--fabric.process_group_timeout_s", "60", *held_run_arguments(), "--checkpoint.every", "1")
    with open(logs / "rank0.out", "w") as stdout, open(logs / "rank0.err", "w") as stderr:
        rank0 = subprocess.Popen(command, env=process_environment(PYTHONPATH=holds.pythonpath()), stdout=stdout,
                                 stderr=stderr)
    try:
        processes.wait_until(lambda: all((out_dir / f"held_rank{rank}").exists() for rank in range(2)), [rank0],
                             f"both ranks held after round {HELD_ROUND}", RUN_TIMEOUT_S)
        children = Path(f"/proc/{rank0.pid}/task/{rank0.pid}/children").read_text().split()
        (rank1,) = [int(pid) for pid in children
                    if "fl_lightning" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
        os.kill(rank1, signal.SIGKILL)
        processes.wait_until(lambda: not Path(f"/proc/{rank1}").exists(), [rank0],
                             "rank 0's launcher reaped rank 1", RUN_TIMEOUT_S)
        (out_dir / "hold").unlink()
        assert rank0.wait(RUN_TIMEOUT_S) == RANK_LOST, (logs / "rank0.err").read_text()
    finally:
        if rank0.poll() is None:
            rank0.kill()
    errors = [line for line in (logs / "rank0.err").read_text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"error: round {HELD_ROUND + 1}: rank 1 (pid {rank1} on {socket.gethostname()}) "
                                "is gone (gloo: ")
    assert errors[0].endswith(f"run the same command again to resume from round {HELD_ROUND}")


SIMULATED_SLURM_TWO_TASKS = {"SLURM_JOB_ID": SLURM_JOB_ID, "SLURM_JOB_NAME": "fault-test", "SLURM_NTASKS": "2",
                             "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"}


def test_bad_input_in_a_real_process(tmp_path):
    """tests/integration/test_bad_inputs.py checks the table of bad inputs in this process; a real process
    exits the same way, here for an allocation that does not match the ranks."""
    out_dir = tmp_path / "run"
    completed = subprocess.run([*FIT, *TRAINING, "--fabric.devices", "1", "--out_dir", str(out_dir)],
                               env=process_environment(**SIMULATED_SLURM_TWO_TASKS), capture_output=True, text=True,
                               timeout=RUN_TIMEOUT_S)
    assert completed.returncode == 2
    assert completed.stderr.splitlines() == [
        "error: fabric.devices: expected the tasks per node of the SLURM allocation (2), got 1"]
    assert not (out_dir / "config.yaml").exists()


# Kills at each step of a round's end, as Slurm kills a job: the whole process group at once,
# W&B's service included. The driver wraps one function of the round loop so that, in the round
# `KILL_ROUND`, the group dies just before or just after it runs.
KILL_ROUND = 4
KILL_DRIVER = """
import os, signal, sys
from fl_lightning import run_logging
from fl_lightning.federation.loop import FederatedLoop
target, when, kill_round = sys.argv[1], sys.argv[2], int(sys.argv[3])
owner = {"save": (FederatedLoop, "save_checkpoint"), "metrics": (run_logging.MetricsLog, "append"),
         "wandb": (run_logging.WandbRun, "log")}[target]
original = getattr(*owner)

def wrapped(*args, **kwargs):
    completed = args[0].completed_rounds if target == "save" else args[-1]["round"]
    if completed == kill_round and when == "before":
        os.killpg(0, signal.SIGKILL)
    result = original(*args, **kwargs)
    if completed == kill_round and when == "after":
        os.killpg(0, signal.SIGKILL)
    return result

setattr(*owner, wrapped)
sys.argv = ["fl-lightning", *sys.argv[4:]]
from fl_lightning.__main__ import main
main()
"""
KILL_POINTS = [("save", "before"), ("save", "after"), ("metrics", "after"), ("wandb", "after")]
KILL_TRAINING = [
    "--config", str(QUICKSTART), "--model.options", "{hidden: 16, depth: 1}", "--logger.progress_bar", "false",
    "--federation.rounds", "6", "--federation.local_steps", "2", "--federation.eval_every", "2",
    "--checkpoint.every", "2", "--logger.wandb_mode", "offline", "--resume", "auto",
]


def newest_offline_history(out_dir: Path) -> list[dict]:
    from wandb_records import history_rows

    run_files = sorted((out_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return history_rows(run_files[-1])


@pytest.fixture(scope="module")
def kill_reference(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("kill-reference") / "run"
    completed = processes.run([*FIT, *KILL_TRAINING, "--out_dir", str(out_dir)], env=process_environment(),
                              timeout=RUN_TIMEOUT_S)
    assert completed.returncode == 0, completed.stderr
    return out_dir


@pytest.mark.parametrize("target, when", KILL_POINTS, ids=[f"{when}-{target}" for target, when in KILL_POINTS])
def test_kill_at_each_step_of_the_round_end_leaves_every_round_logged_once(target, when, kill_reference, tmp_path):
    out_dir = tmp_path / "run"
    killed = processes.run(  # in its own process group, which the driver kills whole
        [sys.executable, "-c", KILL_DRIVER, target, when, str(KILL_ROUND), "fit", *KILL_TRAINING, "--out_dir",
         str(out_dir)], env=process_environment(), timeout=RUN_TIMEOUT_S,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    rows_at_kill = [row["round"] for row in completed_rows(out_dir)]
    # The round's row is appended after its checkpoint is saved.
    assert rows_at_kill == list(range(1, KILL_ROUND if target == "save" else KILL_ROUND + 1))
    with open(out_dir / "metrics.jsonl", "a") as metrics:
        metrics.write('{"round": 99, "train_lo')  # a line torn by the kill must not block the resume

    resumed = processes.run([*FIT, *KILL_TRAINING, "--out_dir", str(out_dir)], env=process_environment(),
                            timeout=RUN_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr
    rows = completed_rows(out_dir)
    assert [row["round"] for row in rows] == list(range(1, 7))
    assert [row["_step"] for row in newest_offline_history(out_dir)] == list(range(1, 7))
    assert [row["round"] for row in newest_offline_history(out_dir)] == list(range(1, 7))
    assert_same_model(final_model(out_dir), final_model(kill_reference))


def wait_for_handler(process: subprocess.Popen, signum: signal.Signals) -> None:
    """Waits until `process` catches `signum` (its SigCgt mask in /proc), so a signal sent next is
    recorded rather than fatal."""
    def caught() -> bool:
        status = Path(f"/proc/{process.pid}/status").read_text()
        mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
        return bool(mask & (1 << (signum - 1)))

    processes.wait_until(caught, [process], f"a handler for {signum.name}", RUN_TIMEOUT_S)


def test_signal_during_start_up_stops_after_round_one_and_the_rerun_matches(reference, tmp_path):
    """A fresh interpreter: the signal lands while it is still importing."""
    out_dir = tmp_path / "run"
    process = subprocess.Popen(fit_command(out_dir), env=process_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_for_handler(process, signal.SIGUSR1)
    assert not (out_dir / "metrics.jsonl").exists()  # still starting: no round has run
    process.send_signal(signal.SIGUSR1)
    stdout, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == 0, stderr
    assert "stopped (signal SIGUSR1; checkpoint saved) at round 1/" in stdout
    assert [checkpoint_round(p) for p in numbered_checkpoints(checkpoint_dir(out_dir))] == [1]
    completed = run_fit(out_dir)
    assert completed.returncode == 0, completed.stderr
    assert [row["round"] for row in completed_rows(out_dir)] == list(range(1, ROUNDS + 1))
    assert_same_model(final_model(out_dir), final_model(reference))


SIGNALS_AFTER_THE_RUN = """
import os, signal, sys
sys.argv = ["fl-lightning", *sys.argv[1:]]
from fl_lightning.__main__ import main
main()
os.kill(os.getpid(), signal.SIGUSR1)
os.kill(os.getpid(), signal.SIGTERM)
print("exited cleanly after the signals", flush=True)
"""


def test_signals_after_the_last_round_do_not_kill_a_finished_run(tmp_path):
    completed = processes.run(
        [sys.executable, "-c", SIGNALS_AFTER_THE_RUN, "fit", *TRAINING, "--federation.rounds", "3",
         "--out_dir", str(tmp_path / "run")], env=process_environment(), timeout=RUN_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr
    assert "exited cleanly after the signals" in completed.stdout


# A stateful algorithm (SCAFFOLD: a client-state index delta per checkpoint), a checkpoint every round,
# only the newest kept: every save prunes the one before.
PRUNED = [
    "--config", str(QUICKSTART), "--algorithm", "scaffold", "--model.options", "{hidden: 16, depth: 1}",
    "--logger.progress_bar", "false", "--federation.rounds", "3", "--federation.local_steps", "2",
    "--federation.eval_every", "3", "--checkpoint.every", "1", "--checkpoint.keep", "1", "--resume", "auto",
]


def test_pruning_removes_a_checkpoints_main_file_and_keeps_the_index_deltas_later_ones_are_made_of(tmp_path,
                                                                                                   monkeypatch):
    removed = []
    unlink = Path.unlink

    def recorded_unlink(path: Path, missing_ok: bool = False) -> None:
        if path.parent.name in ("checkpoints", "index") and not path.name.startswith("."):  # not a temp file
            removed.append(path.name)
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", recorded_unlink)
    out_dir = tmp_path / "run"
    main(["fit", *PRUNED, "--out_dir", str(out_dir)])
    assert removed == ["round_000001.ckpt", "round_000002.ckpt"]
    assert sorted(p.name for p in client_index_path(out_dir, 1, 0).parent.iterdir()) == [
        f"round_00000{r}.rank0.pt" for r in (1, 2, 3)]


def test_start_up_removes_orphan_shards_of_earlier_versions_older_than_the_newest_checkpoint(tmp_path):
    """Checkpoints of earlier versions had client-state shards beside them, which a kill while pruning
    could leave behind."""
    out_dir = tmp_path / "run"
    main(["fit", *PRUNED, "--out_dir", str(out_dir)])
    folder = checkpoint_dir(out_dir)
    kept = {p.name for p in folder.iterdir()}
    assert kept == {"last.ckpt", "round_000003.ckpt"}
    # Left by kills while pruning (main files gone), and the shard of a checkpoint whose main file a
    # kill kept from being written, newer than every complete one.
    orphans = ["round_000001.clients_rank0.pt", "round_000002.clients_rank1.pt"]
    newer = "round_000004.clients_rank0.pt"
    for name in [*orphans, newer]:
        (folder / name).write_bytes(b"a shard")

    main(["fit", *PRUNED, "--out_dir", str(out_dir)])  # finished: trains nothing, but starts up
    assert {p.name for p in folder.iterdir()} == kept | {newer}
