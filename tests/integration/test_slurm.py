"""The batch scripts in slurm/, run by bash under the environment sbatch would give them, with a
stand-in `srun` that records the command it was asked to launch (and, when asked to, waits for a
signal and records which one it got)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from paths import REPOSITORY

from fl_lightning.commands.main import main as fl_lightning_main
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.run_dir import is_safe_to_change

SLURM_DIR = REPOSITORY / "slurm"
BATCH_SCRIPTS = sorted(SLURM_DIR.glob("*.sbatch"))
FIT_SCRIPT = SLURM_DIR / "fit.sbatch"
SWEEP_SCRIPT = SLURM_DIR / "sweep.sbatch"
SUBMIT_SWEEP = SLURM_DIR / "submit_sweep.sh"
LIBRARY = SLURM_DIR / "lib.sh"
# No virtualenv on it: fl-lightning is found only where a test puts a stand-in.
SYSTEM_PATH = "/usr/bin:/bin"
# The sweep plan a sweep task is given (written into the submit folder): 2 methods x 1 seed.
PLAN = "plan.yaml"
PLAN_CONTENT = {"name": "demo", "configs": ["configs/quickstart.yaml"],
                "methods": {"FedAvg": [{"algorithm": "fedavg"}],
                            "FedProx": [{"algorithm": "fedprox"}, {"algorithm.init_args.mu": 0.1}]},
                "settings": {"alpha": {"0.1": [{"data.alpha": 0.1}]}}, "seeds": [3]}
# The stand-in fl-lightning: nothing for `fit` (srun is a stand-in too); for `sweep`, records its
# arguments and prints a config path, or runs the real `fl-lightning sweep` when STAND_IN_PYTHON is set.
STAND_IN_FL_LIGHTNING = """#!/bin/bash
if [[ ${1:-} == sweep ]]; then
    printf "%s\\n" "$@" > "$STAND_IN_DIR/sweep_args.txt"
    if [[ -n ${STAND_IN_PYTHON:-} ]]; then
        exec "$STAND_IN_PYTHON" -m fl_lightning "$@"
    fi
    echo configs/quickstart.yaml
fi
"""

STAND_IN_SRUN = """#!/bin/bash
printf "%s\\n" "$@" > "$STAND_IN_DIR/srun_args.txt"
printf "%s\\n" "SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK-unset}" "OMP_NUM_THREADS=${OMP_NUM_THREADS-unset}" \\
    > "$STAND_IN_DIR/srun_env.txt"
if [[ -n ${STAND_IN_WAIT_FOR_SIGNAL:-} ]]; then
    received() { echo "$1" > "$STAND_IN_DIR/signal.tmp"; mv "$STAND_IN_DIR/signal.tmp" "$STAND_IN_DIR/signal.txt"; \\
                 exit "${STAND_IN_STATUS:-0}"; }
    trap 'received USR1' USR1
    trap 'received TERM' TERM
    touch "$STAND_IN_DIR/srun_ready"
    for (( i = 0; i < 600; i++ )); do sleep 0.05 & wait $!; done  # at most 30 s
    exit 99
fi
if [[ -n ${STAND_IN_SIGNAL_AFTER_SRUN:-} ]]; then  # for the stand-in date: whom to signal, and that srun is done
    echo "$PPID" > "$STAND_IN_DIR/batch_shell_pid"
fi
exit "${STAND_IN_STATUS:-0}"
"""
# A `date` that, once srun has ended, first sends $STAND_IN_SIGNAL_AFTER_SRUN to the batch shell: the
# batch shell calls it for the line it prints after srun, so the signal lands after the wait for srun.
STAND_IN_DATE = """#!/bin/bash
if [[ -f $STAND_IN_DIR/batch_shell_pid ]]; then
    kill -s "$STAND_IN_SIGNAL_AFTER_SRUN" "$(cat "$STAND_IN_DIR/batch_shell_pid")"
fi
exec /bin/date "$@"
"""


@dataclass
class Job:
    status: int
    stdout: str
    stderr: str
    srun_args: list[str]  # [] when srun was not started
    srun_env: dict[str, str]


def sbatch_options(script: Path) -> dict[str, str]:
    """The script's `#SBATCH --name[=value]` lines, read as sbatch does: up to the first command."""
    options = {}
    for line in script.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if match := re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line):
            options[match.group(1)] = match.group(2)
    return options


def allocation_environment(nodes: int = 1, tasks_per_node: int = 1, gpus_per_node=None, **extra: str) -> dict[str, str]:
    """What sbatch exports to a batch script for this allocation; gpus_per_node None: no GPUs asked for."""
    environment = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "fl-test", "SLURM_NNODES": str(nodes),
                   "SLURM_NTASKS_PER_NODE": str(tasks_per_node), "SLURM_NTASKS": str(nodes * tasks_per_node)}
    if gpus_per_node is not None:
        environment["SLURM_GPUS_PER_NODE"] = str(gpus_per_node)
    return {**environment, **extra}


def submit_dir(tmp_path: Path) -> Path:
    """The folder the job is submitted from: a checkout's configs/ and slurm/lib.sh, and a sweep plan."""
    directory = tmp_path / "submit"
    if not directory.exists():
        (directory / "slurm").mkdir(parents=True)
        (directory / "configs").symlink_to(REPOSITORY / "configs")
        shutil.copy(LIBRARY, directory / "slurm" / "lib.sh")
        (directory / PLAN).write_text(yaml.safe_dump(PLAN_CONTENT, sort_keys=False))
    return directory


def is_sweep(script: Path) -> bool:
    return "fl-lightning sweep" in script.read_text()


def script_arguments(script: Path, args=()) -> list[str]:
    """A sweep task's batch script takes the plan first."""
    return [PLAN, *args] if is_sweep(script) else list(args)


def stand_ins(tmp_path: Path, with_fl_lightning: bool = True) -> Path:
    """bin/ with the stand-in srun and, unless told otherwise, an fl-lightning that does nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(STAND_IN_SRUN)
    (bin_dir / "srun").chmod(0o755)
    fl_lightning = bin_dir / "fl-lightning"
    if with_fl_lightning:
        fl_lightning.write_text(STAND_IN_FL_LIGHTNING)
        fl_lightning.chmod(0o755)
    else:
        fl_lightning.unlink(missing_ok=True)
    return bin_dir


def job_environment(tmp_path: Path, environment: dict[str, str], with_fl_lightning: bool = True) -> dict[str, str]:
    bin_dir = stand_ins(tmp_path, with_fl_lightning)
    return {"PATH": f"{bin_dir}{os.pathsep}{SYSTEM_PATH}", "HOME": str(tmp_path), "STAND_IN_DIR": str(tmp_path),
            "SLURM_SUBMIT_DIR": str(submit_dir(tmp_path)), **environment}


def launched(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    args, env = tmp_path / "srun_args.txt", tmp_path / "srun_env.txt"
    return (args.read_text().splitlines() if args.exists() else [],
            dict(line.split("=", 1) for line in env.read_text().splitlines()) if env.exists() else {})


def run_script(script: Path, tmp_path: Path, environment: dict[str, str], args=(), with_fl_lightning=True) -> Job:
    """Run `script` with bash from the submit folder, as the batch shell of a job."""
    for record in ("srun_args.txt", "srun_env.txt", "sweep_args.txt"):
        (tmp_path / record).unlink(missing_ok=True)
    env = job_environment(tmp_path, environment, with_fl_lightning)
    completed = subprocess.run(["bash", str(script), *script_arguments(script, args)], env=env,
                               cwd=submit_dir(tmp_path), capture_output=True, text=True, timeout=60)
    return Job(completed.returncode, completed.stdout, completed.stderr, *launched(tmp_path))


def option_value(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} given {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, f"exited {process.returncode} before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} after {seconds} s"
        time.sleep(0.02)


def end_group(process: subprocess.Popen) -> tuple[str, str]:
    """Kill what is left of the process group `process` leads; its stdout and stderr."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return process.communicate(timeout=15)


# --- the files ---------------------------------------------------------------------------------

@pytest.mark.parametrize("script", sorted(SLURM_DIR.iterdir()), ids=lambda p: p.name)
def test_script_is_valid_bash(script):
    completed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_one_template_and_a_sweep_share_the_launch():
    assert [p.name for p in BATCH_SCRIPTS] == ["fit.sbatch", "sweep.sbatch"]
    for script in BATCH_SCRIPTS:
        commands = [line for line in script.read_text().splitlines() if not line.lstrip().startswith("#")]
        assert not any(re.search(r"\bsrun\b|SLURM_NTASKS_PER_NODE|SLURM_GPUS", line) for line in commands), script
        assert any(re.fullmatch(r'\s*source "\$FL_LIB"', line) for line in commands)


@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
def test_header_submits_anywhere_requeues_and_logs_to_logs(script):
    options = sbatch_options(script)
    assert "requeue" in options
    assert options["open-mode"] == "append"  # a requeued job appends to its log
    # No `B:` prefix: the signal goes to the srun tasks (the ranks), not only the batch shell.
    assert options["signal"] == "USR1@180"
    assert options["output"].startswith("logs/%x-")
    # Nothing a CPU-only or small node cannot give: GPUs and CPUs per task come from the command line.
    assert not {"gpus-per-node", "gres", "gpus", "cpus-per-task"} & set(options)
    assert options["nodes"] == "1" and options["ntasks-per-node"] == "1"


def test_the_log_folder_is_in_every_checkout():
    """sbatch does not create the folder of --output, and a job without it fails with no log at all:
    logs/ is kept in the repository, its contents ignored."""
    assert (REPOSITORY / "logs" / ".gitignore").read_text().split() == ["*", "!.gitignore"]
    for script in BATCH_SCRIPTS:
        assert Path(sbatch_options(script)["output"]).parent == Path("logs")
        assert "mkdir -p logs" not in script.read_text()


# --- the allocation ----------------------------------------------------------------------------

@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
@pytest.mark.parametrize("nodes, tasks_per_node", [(1, 1), (1, 3), (2, 1), (4, 2)], ids=str)
def test_cpu_only_allocation_runs_on_cpu(script, nodes, tasks_per_node, tmp_path):
    job = run_script(script, tmp_path, allocation_environment(nodes, tasks_per_node, SLURM_ARRAY_TASK_ID="0"))
    assert job.status == 0, job.stderr
    assert job.srun_args[:3] == ["--kill-on-bad-exit=1", "fl-lightning", "fit"]
    assert option_value(job.srun_args, "--fabric.accelerator") == "cpu"
    assert option_value(job.srun_args, "--fabric.devices") == str(tasks_per_node)
    assert option_value(job.srun_args, "--fabric.num_nodes") == str(nodes)
    assert option_value(job.srun_args, "--resume") == "auto"
    assert option_value(job.srun_args, "--checkpoint.requeue_signal") == "SIGUSR1"


@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
@pytest.mark.parametrize("gpu_variables", [
    {"SLURM_GPUS_PER_NODE": "4"},  # --gpus-per-node=4
    {"SLURM_GPUS_PER_NODE": "a100:4"},  # --gpus-per-node=a100:4
    {"SLURM_GPUS_ON_NODE": "4"},  # --gres=gpu:4
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_gpu_allocation_runs_one_rank_per_gpu(script, gpu_variables, tmp_path):
    environment = allocation_environment(2, 4, SLURM_ARRAY_TASK_ID="0", **gpu_variables)
    job = run_script(script, tmp_path, environment)
    assert job.status == 0, job.stderr
    assert option_value(job.srun_args, "--fabric.accelerator") == "gpu"
    assert option_value(job.srun_args, "--fabric.devices") == "4"
    assert option_value(job.srun_args, "--fabric.num_nodes") == "2"


def test_zero_gpus_per_node_is_a_cpu_job(tmp_path):
    job = run_script(FIT_SCRIPT, tmp_path, allocation_environment(1, 2, 0))  # sbatch --gpus-per-node=0
    assert job.status == 0, job.stderr
    assert option_value(job.srun_args, "--fabric.accelerator") == "cpu"


def test_accelerator_can_be_chosen(tmp_path):
    job = run_script(FIT_SCRIPT, tmp_path, allocation_environment(1, 2, 4, ACCELERATOR="cpu"))
    assert job.status == 0, job.stderr  # GPUs given but not used: no GPU check
    assert option_value(job.srun_args, "--fabric.accelerator") == "cpu"


@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
@pytest.mark.parametrize("gpus, accelerator, message", [
    (2, None, "--gpus-per-node (2) must equal --ntasks-per-node (4)"),
    ("a100:2", "gpu", "--gpus-per-node (2) must equal --ntasks-per-node (4)"),
    (None, "gpu", "ACCELERATOR=gpu but the job has no GPUs"),
    (None, "tpu", "ACCELERATOR must be gpu or cpu, not 'tpu'"),
])
def test_allocation_that_cannot_work_stops_before_srun(script, gpus, accelerator, message, tmp_path):
    extra = {"ACCELERATOR": accelerator} if accelerator else {}
    job = run_script(script, tmp_path, allocation_environment(1, 4, gpus, SLURM_ARRAY_TASK_ID="0", **extra))
    assert job.status == 1
    assert message in job.stderr
    assert job.srun_args == []


def test_outside_sbatch_the_script_says_so(tmp_path):
    job = run_script(FIT_SCRIPT, tmp_path, {})
    assert job.status == 1 and "submit this script with sbatch" in job.stderr
    assert job.srun_args == []


@pytest.mark.parametrize("cpus_per_task, srun_cpus", [(None, "unset"), ("3", "3")])
def test_cpus_per_task_reach_the_ranks(cpus_per_task, srun_cpus, tmp_path, monkeypatch):
    """srun gets the job's CPUs per task, and each rank chooses its threads from them
    (fl_lightning.cpu): the script sets no OMP_NUM_THREADS, which would override that choice."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    extra = {"SLURM_CPUS_PER_TASK": cpus_per_task} if cpus_per_task else {}
    job = run_script(FIT_SCRIPT, tmp_path, allocation_environment(1, 2, **extra))
    assert job.status == 0, job.stderr
    assert job.srun_env == {"SRUN_CPUS_PER_TASK": srun_cpus, "OMP_NUM_THREADS": "unset"}


# --- the environment hook ----------------------------------------------------------------------

def test_without_fl_lightning_on_path_the_error_says_how_to_set_the_hook(tmp_path):
    job = run_script(FIT_SCRIPT, tmp_path, allocation_environment(), with_fl_lightning=False)
    assert job.status == 1
    assert "fl-lightning is not on PATH" in job.stderr
    assert "FL_ACTIVATE='source .venv/bin/activate'" in job.stderr
    assert job.srun_args == []


def test_the_activation_hook_runs_before_srun(tmp_path):
    venv_bin = submit_dir(tmp_path) / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "fl-lightning").write_text("#!/bin/bash\n")
    (venv_bin / "fl-lightning").chmod(0o755)
    # Like real activation scripts, it reads variables that may be unset (the script runs with set -u).
    (venv_bin / "activate").write_text(
        'if [ -n "${NOT_SET_ANYWHERE}" ]; then :; fi\nexport PATH="$PWD/venv/bin:$PATH"\nhash -r\n')
    environment = allocation_environment(FL_ACTIVATE="source venv/bin/activate && export ACTIVATED=yes")
    job = run_script(FIT_SCRIPT, tmp_path, environment, with_fl_lightning=False)
    assert job.status == 0, job.stderr
    assert "activating the environment: source venv/bin/activate" in job.stdout
    assert job.srun_args[1] == "fl-lightning"


def test_a_failing_activation_hook_stops_the_job(tmp_path):
    job = run_script(FIT_SCRIPT, tmp_path, allocation_environment(FL_ACTIVATE="conda activate nowhere"))
    assert job.status == 1
    assert "FL_ACTIVATE (conda activate nowhere) failed with exit status 127" in job.stderr
    assert job.srun_args == []


# --- finding slurm/lib.sh from sbatch's copy of the script -------------------------------------

@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
def test_spooled_copy_finds_the_library_in_the_submit_folder(script, tmp_path):
    spool = tmp_path / "spool" / "job4242"
    spool.mkdir(parents=True)
    shutil.copy(script, spool / "slurm_script")
    job = run_script(spool / "slurm_script", tmp_path, allocation_environment(SLURM_ARRAY_TASK_ID="0"))
    assert job.status == 0, job.stderr
    assert job.srun_args[1:3] == ["fl-lightning", "fit"]

    job = run_script(spool / "slurm_script", tmp_path, allocation_environment(SLURM_SUBMIT_DIR=str(tmp_path)))
    assert job.status == 1
    assert f"{tmp_path}/slurm/lib.sh not found: submit from the repository root" in job.stderr


def test_a_missing_config_is_named(tmp_path):
    job = run_script(FIT_SCRIPT, tmp_path, allocation_environment(CONFIG="configs/nothing.yaml"))
    assert job.status == 1
    assert "config file 'configs/nothing.yaml' not found" in job.stderr and "repository root" in job.stderr


# --- signals to the batch shell ----------------------------------------------------------------

@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
@pytest.mark.parametrize("signal_name, srun_status", [("USR1", 0), ("TERM", 0), ("TERM", 3)])
def test_batch_shell_forwards_usr1_and_term_to_srun(script, signal_name, srun_status, tmp_path):
    """`scancel -s USR1 --batch JOB` signals only the batch shell: it must pass the signal to the
    srun step and then exit with srun's status, not die of it."""
    env = job_environment(tmp_path, allocation_environment(SLURM_ARRAY_TASK_ID="0", STAND_IN_WAIT_FOR_SIGNAL="1",
                                                           STAND_IN_STATUS=str(srun_status)))
    batch_shell = subprocess.Popen(["bash", str(script), *script_arguments(script)], env=env, cwd=submit_dir(tmp_path),
                                   start_new_session=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(tmp_path / "srun_ready", batch_shell)  # srun runs, with its traps in place
        os.kill(batch_shell.pid, getattr(signal, f"SIG{signal_name}"))  # the batch shell only
        wait_for(tmp_path / "signal.txt", batch_shell)
        batch_shell.wait(timeout=15)
    except (AssertionError, subprocess.TimeoutExpired) as failure:
        raise AssertionError(f"{failure}\n{end_group(batch_shell)}") from None
    stdout, stderr = end_group(batch_shell)
    assert (tmp_path / "signal.txt").read_text().strip() == signal_name
    assert f"batch shell got SIG{signal_name}: forwarding it to srun" in stderr
    assert batch_shell.returncode == srun_status, stderr
    assert f"srun exited with status {srun_status}" in stdout


@pytest.mark.parametrize("signal_name", ["USR1", "TERM"])
def test_a_signal_to_the_batch_shell_after_srun_ended_leaves_the_jobs_status_to_srun(signal_name, tmp_path):
    """`scancel --batch` or `--full` a moment after the run ended: the batch shell must not die of it."""
    bin_dir = stand_ins(tmp_path)
    (bin_dir / "date").write_text(STAND_IN_DATE)
    (bin_dir / "date").chmod(0o755)
    job = run_script(FIT_SCRIPT, tmp_path, allocation_environment(STAND_IN_SIGNAL_AFTER_SRUN=signal_name))
    assert (tmp_path / "batch_shell_pid").exists()  # the signal was sent
    assert job.status == 0, job.stderr
    assert "srun exited with status 0" in job.stdout


@pytest.mark.parametrize("srun_status", [0, 1, 42])
def test_job_exits_with_the_status_of_srun(srun_status, tmp_path):
    job = run_script(FIT_SCRIPT, tmp_path, allocation_environment(STAND_IN_STATUS=str(srun_status)))
    assert job.status == srun_status, job.stderr
    assert job.srun_args


# --- out_dir ----------------------------------------------------------------------------------

# What fit.sbatch adds in front of the user's arguments, each option with its value.
SCRIPT_OPTIONS = ("--fabric.accelerator", "--fabric.devices", "--fabric.num_nodes", "--checkpoint.requeue_signal",
                  "--resume", "--logger.wandb_mode", "--logger.progress_bar")
RESTART_GUARD = ["--resume", "auto", "--overwrite", "false"]


def test_without_out_dir_fit_chooses_the_folder(tmp_path):
    job = run_script(FIT_SCRIPT, tmp_path, allocation_environment(), args=["--client_optimizer.lr", "0.1"])
    assert job.status == 0, job.stderr
    assert "--out_dir" not in job.srun_args and not any(a.startswith("--out_dir=") for a in job.srun_args)
    assert "out_dir chosen by fit (see its 'run folder:' line)" in job.stdout
    # fit names the folder after the settings that define the experiment: the script must add none
    # of them, so that a job lands where the same command run by hand would, on any allocation.
    added = job.srun_args[5:-2]  # after `--kill-on-bad-exit=1 fl-lightning fit --config FILE`, before the user's
    assert added[::2] == list(SCRIPT_OPTIONS)
    assert all(is_safe_to_change(option.removeprefix("--")) for option in added[::2])
    assert job.srun_args[-2:] == ["--client_optimizer.lr", "0.1"]


def test_out_dir_can_be_given(tmp_path):
    job = run_script(FIT_SCRIPT, tmp_path, allocation_environment(OUT_DIR="runs/my run"), args=["--seed", "3"])
    assert job.status == 0, job.stderr
    assert option_value(job.srun_args, "--out_dir") == "runs/my run"
    assert job.srun_args[-2:] == ["--seed", "3"]  # the user's arguments still come last
    assert "out_dir runs/my run" in job.stdout  # the log says where the run goes


@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
def test_a_requeued_or_resubmitted_job_launches_the_same_run(script, tmp_path):
    """A requeued job keeps its id, a resubmitted one does not: both must launch the same command,
    so that fit finds the same folder; a requeued attempt also continues it whatever was asked at
    submission."""
    launches = {}
    for job_id, restart in (("4242", "0"), ("4242", "1"), ("5151", "0"), ("5151", "3")):
        environment = allocation_environment(SLURM_ARRAY_TASK_ID="3", SLURM_JOB_ID=job_id,
                                             SLURM_RESTART_COUNT=restart, WANDB_MODE="offline")
        job = run_script(script, tmp_path, environment, args=["--seed", "2"] if script == FIT_SCRIPT else [])
        assert job.status == 0, job.stderr
        before_guard = job.srun_args[:-len(RESTART_GUARD)] if restart != "0" else job.srun_args
        assert option_value(before_guard, "--logger.wandb_mode") == "offline"
        launches[job_id, restart] = job.srun_args
        assert ("continuing the run in its folder" in job.stdout) == (restart != "0")
    first = launches["4242", "0"]
    assert launches["5151", "0"] == first
    assert launches["4242", "1"] == launches["5151", "3"] == [*first, *RESTART_GUARD]


# A sweep task takes no fit arguments (the plan holds every setting): these are fit.sbatch's.
@pytest.mark.parametrize("script", [FIT_SCRIPT], ids=lambda p: p.name)
def test_a_requeued_attempt_never_starts_over_again(script, tmp_path):
    """`--resume null --overwrite true` at submission starts over once; the attempts after a requeue
    continue from the checkpoints the first one wrote instead of wiping them."""
    start_over = ["--resume", "null", "--overwrite", "true"]
    environment = allocation_environment(SLURM_ARRAY_TASK_ID="0")
    first = run_script(script, tmp_path, environment, args=start_over)
    assert first.status == 0, first.stderr
    assert first.srun_args[-4:] == start_over
    requeued = run_script(script, tmp_path, {**environment, "SLURM_RESTART_COUNT": "1"}, args=start_over)
    assert requeued.status == 0, requeued.stderr
    assert requeued.srun_args == [*first.srun_args, *RESTART_GUARD]  # later options win


@pytest.mark.parametrize("script", [FIT_SCRIPT], ids=lambda p: p.name)
def test_extra_arguments_reach_fit_last(script, tmp_path):
    job = run_script(script, tmp_path, allocation_environment(SLURM_ARRAY_TASK_ID="0"),
                     args=["--federation.rounds", "7"])
    assert job.status == 0, job.stderr
    assert job.srun_args[-2:] == ["--federation.rounds", "7"]
    assert job.srun_args[3:5] == ["--config", "configs/quickstart.yaml"]  # first: everything overrides it


# --- the sweep ---------------------------------------------------------------------------------

def test_the_sweep_array_is_sized_at_submission():
    """`fl-lightning sweep --mode submit` passes --array=0-(grid size - 1) (tests/experiments/sweeps/test_sweep.py): the
    header has no array of its own to get out of step with a plan."""
    assert "array" not in sbatch_options(SWEEP_SCRIPT)


def test_a_sweep_task_asks_fl_lightning_sweep_for_its_grid_point(tmp_path):
    environment = allocation_environment(SLURM_ARRAY_JOB_ID="4242", SLURM_ARRAY_TASK_ID="1")
    job = run_script(SWEEP_SCRIPT, tmp_path, environment, args=["--runs_root", "elsewhere"])
    assert job.status == 0, job.stderr
    assert (tmp_path / "sweep_args.txt").read_text().splitlines() == [
        "sweep", "--plan", PLAN, "--mode", "fit_config", "--index", "1", "--runs_root", "elsewhere"]
    # fit on the config it printed, then the allocation's devices and the launch options, as fit.sbatch.
    assert job.srun_args[:5] == ["--kill-on-bad-exit=1", "fl-lightning", "fit", "--config", "configs/quickstart.yaml"]
    assert job.srun_args[5:][::2] == list(SCRIPT_OPTIONS)
    assert f"task 1 of array job 4242: grid point 1 of {PLAN}, config configs/quickstart.yaml" in job.stdout


@pytest.mark.parametrize("environment, arguments, message", [
    ({"SLURM_ARRAY_TASK_ID": "0"}, [], "no plan given: submit with fl-lightning sweep --plan PLAN --mode submit"),
    ({"SLURM_ARRAY_TASK_ID": "0"}, ["nowhere.yaml"], "plan 'nowhere.yaml' not found"),
    ({}, [PLAN], "not an array task: submit with fl-lightning sweep --plan plan.yaml --mode submit"),
], ids=["no plan", "missing plan", "not an array"])
def test_a_sweep_task_without_its_plan_or_index_stops_before_srun(environment, arguments, message, tmp_path):
    env = job_environment(tmp_path, allocation_environment(**environment))
    completed = subprocess.run(["bash", str(SWEEP_SCRIPT), *arguments], env=env, cwd=submit_dir(tmp_path),
                               capture_output=True, text=True, timeout=30)
    assert completed.returncode == 1
    assert message in completed.stderr
    assert launched(tmp_path) == ([], {})


@pytest.mark.slow
def test_each_sweep_task_launches_its_grid_point(tmp_path, capsys, monkeypatch):
    """With the real `fl-lightning sweep --mode fit_config`: task I launches fit on point I's settings,
    resolved into its run folder, and the allocation's devices win over the plan's (the quickstart
    config it starts from says cpu and 1 device)."""
    points = load_plan(submit_dir(tmp_path) / PLAN).grid()
    monkeypatch.chdir(submit_dir(tmp_path))  # the plan's paths are relative to the submit folder
    for point, gpus_per_node, accelerator in zip(points, (None, 4), ("cpu", "gpu")):
        environment = allocation_environment(2, 4, gpus_per_node, SLURM_ARRAY_TASK_ID=str(point.index),
                                             STAND_IN_PYTHON=sys.executable)
        job = run_script(SWEEP_SCRIPT, tmp_path, environment)
        assert job.status == 0, job.stderr
        config = point.out_dir / "sweep_fit.yaml"
        assert option_value(job.srun_args, "--config") == str(config)
        assert (submit_dir(tmp_path) / config).is_file()
        fit_args = job.srun_args[job.srun_args.index("fl-lightning") + 1:]
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            fl_lightning_main([*fit_args, "--print_config"])
        assert exited.value.code in (None, 0), capsys.readouterr().err
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["out_dir"] == str(point.out_dir) and printed["seed"] == point.seed == 3
        assert printed["data"]["alpha"] == 0.1
        assert printed["algorithm"]["class_path"].endswith(point.method)
        assert printed["logger"]["name"] == f"{point.method.lower()}-seed3"
        assert printed["fabric"] == {**printed["fabric"], "accelerator": accelerator, "devices": 4, "num_nodes": 2}
        assert printed["resume"] == "auto"
    assert [p.method for p in points] == ["FedAvg", "FedProx"]


@pytest.mark.slow
def test_a_sweep_task_outside_the_grid_fails_before_srun(tmp_path):
    environment = allocation_environment(SLURM_ARRAY_TASK_ID="2", STAND_IN_PYTHON=sys.executable)
    job = run_script(SWEEP_SCRIPT, tmp_path, environment)
    assert job.status == 2
    assert f"error: index: expected a grid point of {PLAN}: 0-1, got 2" in job.stderr
    assert job.srun_args == []


def test_submit_sweep_is_fl_lightning_sweep_slurm(tmp_path):
    env = job_environment(tmp_path, {})
    script = submit_dir(tmp_path) / "slurm" / "submit_sweep.sh"
    script.write_text(SUBMIT_SWEEP.read_text())
    completed = subprocess.run(["bash", "slurm/submit_sweep.sh", PLAN, "--jobs", "4"], env=env,
                               cwd=submit_dir(tmp_path), capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "sweep_args.txt").read_text().splitlines() == [
        "sweep", "--plan", PLAN, "--mode", "submit", "--jobs", "4"]
    completed = subprocess.run(["bash", "slurm/submit_sweep.sh"], env=env, cwd=submit_dir(tmp_path),
                               capture_output=True, text=True)
    assert completed.returncode == 2 and "usage: bash slurm/submit_sweep.sh PLAN" in completed.stderr


# --- what reaches fit parses -------------------------------------------------------------------

@pytest.mark.parametrize("script", [FIT_SCRIPT], ids=lambda p: p.name)
@pytest.mark.parametrize("gpus_per_node, accelerator, restart", [(None, "cpu", "0"), (4, "gpu", "0"), (4, "gpu", "2")])
def test_the_launched_command_line_parses(script, gpus_per_node, accelerator, restart, tmp_path, capsys, monkeypatch):
    """Every option the script passes exists in `fit` and takes the value given (no typo reaches the
    cluster); --print_config parses without training. A requeued attempt resumes even when the
    job was submitted to start over."""
    environment = allocation_environment(2, 4, gpus_per_node, SLURM_ARRAY_TASK_ID="5", SLURM_RESTART_COUNT=restart)
    job = run_script(script, tmp_path, environment, args=["--resume", "null", "--overwrite", "true"])
    assert job.status == 0, job.stderr
    fit_args = job.srun_args[job.srun_args.index("fl-lightning") + 1:]
    monkeypatch.chdir(REPOSITORY)  # the scripts run from the repository (--config is relative)
    with pytest.raises(SystemExit) as exited:
        fl_lightning_main([*fit_args, "--print_config"])
    assert exited.value.code in (None, 0), capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "devices: 4" in printed and "num_nodes: 2" in printed
    assert f"accelerator: {accelerator}" in printed
    if restart == "0":
        assert re.search(r"^resume: null$", printed, re.M) and re.search(r"^overwrite: true$", printed, re.M)
    else:
        assert re.search(r"^resume: auto$", printed, re.M) and re.search(r"^overwrite: false$", printed, re.M)
