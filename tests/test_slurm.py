"""The sbatch scripts in slurm/, run by bash under the environment sbatch would give them, with a
stand-in `srun` that records the command it was asked to launch."""

import itertools
import os
import re
import subprocess
from pathlib import Path

import pytest

from fl_lightning.cli import main as fl_lightning_main

REPOSITORY = Path(__file__).resolve().parents[1]
SLURM_DIR = REPOSITORY / "slurm"
BATCH_SCRIPTS = sorted(SLURM_DIR.glob("*.sbatch"))
SWEEP_SCRIPT = SLURM_DIR / "sweep.sbatch"
SUBMIT_SWEEP = SLURM_DIR / "submit_sweep.sh"


def sbatch_options(script: Path) -> dict[str, str]:
    """The script's `#SBATCH --name[=value]` lines, read as sbatch does: up to the first command."""
    options = {}
    for line in script.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if match := re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line):
            options[match.group(1)] = match.group(2)
    return options


def grid_arrays(script: Path) -> dict[str, list[str]]:
    return {name: re.search(rf"^{name}=\((.*)\)$", script.read_text(), re.M).group(1).split()
            for name in ("ALGORITHMS", "ALPHAS", "SEEDS")}


def allocation_environment(nodes: int, tasks_per_node: int, gpus_per_node: int, **extra: str) -> dict[str, str]:
    """What sbatch exports to a batch script for this allocation."""
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "fl-test", "SLURM_NNODES": str(nodes),
            "SLURM_NTASKS_PER_NODE": str(tasks_per_node), "SLURM_NTASKS": str(nodes * tasks_per_node),
            "SLURM_GPUS_PER_NODE": str(gpus_per_node), "SLURM_CPUS_PER_TASK": "8", **extra}


def stand_in(bin_dir: Path, name: str, record: Path) -> None:
    """An executable `name` in bin_dir that writes its arguments, one per line, to `record`."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {record}\n')
    (bin_dir / name).chmod(0o755)


def run_script(script: Path, tmp_path: Path, environment: dict[str, str], args=()) -> tuple[int, str, list[str]]:
    """Run `script` with bash; returns (exit status, stderr, the arguments srun got or [])."""
    srun_args = tmp_path / "srun_args.txt"
    srun_args.unlink(missing_ok=True)
    stand_in(tmp_path / "bin", "srun", srun_args)
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), **environment}
    completed = subprocess.run(["bash", str(script), *args], env=env, cwd=tmp_path, capture_output=True, text=True)
    launched = srun_args.read_text().splitlines() if srun_args.exists() else []
    return completed.returncode, completed.stderr, launched


def option_value(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} given {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


@pytest.mark.parametrize("script", [*BATCH_SCRIPTS, SUBMIT_SWEEP], ids=lambda p: p.name)
def test_script_is_valid_bash(script):
    completed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_all_three_batch_scripts_exist():
    assert [p.name for p in BATCH_SCRIPTS] == ["multi_node.sbatch", "single_node.sbatch", "sweep.sbatch"]


@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
def test_header_asks_for_requeue_and_an_early_signal_to_every_task(script):
    options = sbatch_options(script)
    assert "requeue" in options
    assert options["open-mode"] == "append"  # a requeued job appends to its log
    # No `B:` prefix: the signal goes to the srun tasks (the ranks), not only the batch shell.
    assert re.fullmatch(r"USR1@180", options["signal"])
    assert options["gpus-per-node"] == options["ntasks-per-node"]


@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
@pytest.mark.parametrize("allocation", ["as written", (1, 1), (1, 8), (4, 2)], ids=str)
def test_fit_gets_the_allocations_devices_and_nodes(script, allocation, tmp_path):
    if allocation == "as written":
        options = sbatch_options(script)
        nodes, tasks_per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    else:
        nodes, tasks_per_node = allocation  # as if overridden on the sbatch command line
    environment = allocation_environment(nodes, tasks_per_node, tasks_per_node, SLURM_ARRAY_TASK_ID="0")
    status, stderr, srun_args = run_script(script, tmp_path, environment)
    assert status == 0, stderr
    assert srun_args[srun_args.index("fl-lightning"):][:2] == ["fl-lightning", "fit"]
    assert option_value(srun_args, "--fabric.devices") == str(tasks_per_node)
    assert option_value(srun_args, "--fabric.num_nodes") == str(nodes)
    assert option_value(srun_args, "--resume") == "auto"
    assert option_value(srun_args, "--checkpoint.requeue_signal") == "SIGUSR1"


def test_multi_node_script_asks_for_several_nodes():
    assert int(sbatch_options(SLURM_DIR / "multi_node.sbatch")["nodes"]) > 1
    assert int(sbatch_options(SLURM_DIR / "single_node.sbatch")["nodes"]) == 1


@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
def test_gpus_that_differ_from_tasks_stop_before_srun(script, tmp_path):
    environment = allocation_environment(1, 4, 2, SLURM_ARRAY_TASK_ID="0")
    status, stderr, srun_args = run_script(script, tmp_path, environment)
    assert status != 0
    assert "--gpus-per-node (2) must equal --ntasks-per-node (4)" in stderr
    assert srun_args == []


@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
def test_out_dir_and_wandb_mode_survive_a_restart(script, tmp_path):
    """A requeued job keeps its id, a resubmitted one does not: both must find the same out_dir."""
    out_dirs = set()
    for job_id, restart in (("4242", "0"), ("4242", "1"), ("5151", "0")):
        environment = allocation_environment(1, 1, 1, SLURM_ARRAY_TASK_ID="3", SLURM_JOB_ID=job_id,
                                             SLURM_RESTART_COUNT=restart, WANDB_MODE="offline")
        status, stderr, srun_args = run_script(script, tmp_path, environment)
        assert status == 0, stderr
        out_dirs.add(option_value(srun_args, "--out_dir"))
        assert option_value(srun_args, "--logger.wandb_mode") == "offline"
    assert len(out_dirs) == 1


def test_extra_arguments_reach_fit(tmp_path):
    environment = allocation_environment(1, 4, 4)
    status, stderr, srun_args = run_script(SLURM_DIR / "single_node.sbatch", tmp_path, environment,
                                           args=["--federation.rounds", "7"])
    assert status == 0, stderr
    assert srun_args[-2:] == ["--federation.rounds", "7"]


def test_sweep_array_matches_the_grid():
    grid = grid_arrays(SWEEP_SCRIPT)
    grid_size = len(grid["ALGORITHMS"]) * len(grid["ALPHAS"]) * len(grid["SEEDS"])
    assert sbatch_options(SWEEP_SCRIPT)["array"] == f"0-{grid_size - 1}"
    printed = subprocess.run(["bash", str(SWEEP_SCRIPT), "--grid-size"], capture_output=True, text=True).stdout
    assert int(printed) == grid_size


def sweep_launches(script: Path, tmp_path: Path, grid_size: int) -> list[list[str]]:
    launches = []
    for task in range(grid_size):
        environment = allocation_environment(1, 1, 1, SLURM_ARRAY_JOB_ID="4242", SLURM_ARRAY_TASK_ID=str(task),
                                             SLURM_JOB_ID=str(5000 + task))
        status, stderr, srun_args = run_script(script, tmp_path, environment)
        assert status == 0, stderr
        launches.append(srun_args)
    return launches


def check_tasks_cover_the_grid(script: Path, tmp_path: Path) -> None:
    grid = grid_arrays(script)
    points = set(itertools.product(grid["ALGORITHMS"], grid["ALPHAS"], grid["SEEDS"]))
    launches = sweep_launches(script, tmp_path, len(points))
    chosen = [(option_value(a, "--algorithm"), option_value(a, "--data.alpha"), option_value(a, "--seed"))
              for a in launches]
    assert set(chosen) == points and len(chosen) == len(points)  # one task per point, none twice
    out_dirs = {option_value(a, "--out_dir") for a in launches}
    assert len(out_dirs) == len(points)
    for (algorithm, alpha, seed), args in zip(chosen, launches):
        run_name = f"{algorithm}-a{alpha}-s{seed}"
        assert option_value(args, "--out_dir").endswith("/" + run_name)
        assert option_value(args, "--logger.name") == run_name
        # Seeds of one (algorithm, alpha) share a W&B group, so the dashboard averages over them.
        assert option_value(args, "--logger.group").endswith(f"{algorithm}-a{alpha}")
    listed = subprocess.run(["bash", str(script), "--list"], capture_output=True, text=True).stdout.splitlines()
    assert [line.split()[1:] for line in listed] == [
        [*point, option_value(args, "--out_dir")] for point, args in zip(chosen, launches)]


def test_each_sweep_task_trains_its_own_grid_point(tmp_path):
    check_tasks_cover_the_grid(SWEEP_SCRIPT, tmp_path)


def edited_sweep(tmp_path: Path) -> Path:
    """sweep.sbatch with its grid replaced by a sample one (2 x 1 x 3), as a user would edit it."""
    text = SWEEP_SCRIPT.read_text()
    text = re.sub(r"^ALGORITHMS=\(.*\)$", "ALGORITHMS=(ctpfl fedavg)", text, flags=re.M)
    text = re.sub(r"^ALPHAS=\(.*\)$", "ALPHAS=(0.05)", text, flags=re.M)
    text = re.sub(r"^SEEDS=\(.*\)$", "SEEDS=(3 4 5)", text, flags=re.M)
    edited = tmp_path / "slurm" / "sweep.sbatch"
    edited.parent.mkdir()
    edited.write_text(text)
    return edited


def test_an_edited_grid_is_covered_too(tmp_path):
    check_tasks_cover_the_grid(edited_sweep(tmp_path), tmp_path)


@pytest.mark.parametrize("task", ["-1", "18", "1000"])
def test_sweep_task_outside_the_grid_fails_before_srun(task, tmp_path):
    environment = allocation_environment(1, 1, 1, SLURM_ARRAY_TASK_ID=task)
    status, stderr, srun_args = run_script(SWEEP_SCRIPT, tmp_path, environment)
    assert status != 0
    assert f"array task {task} is outside the grid of 18 points" in stderr
    assert srun_args == []


@pytest.mark.parametrize("max_parallel, sbatch_args, fit_args, array", [
    (None, [], [], "0-5"),
    ("2", ["--partition", "gpu"], ["--federation.rounds", "9"], "0-5%2"),
])
def test_submit_sweep_sizes_the_array_to_the_grid(max_parallel, sbatch_args, fit_args, array, tmp_path):
    sweep = edited_sweep(tmp_path)  # 6 points
    (sweep.parent / "submit_sweep.sh").write_text(SUBMIT_SWEEP.read_text())
    record = tmp_path / "sbatch_args.txt"
    stand_in(tmp_path / "bin", "sbatch", record)
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    if max_parallel:
        env["MAX_PARALLEL"] = max_parallel
    separator = ["--"] if fit_args else []
    completed = subprocess.run(["bash", str(sweep.parent / "submit_sweep.sh"), *sbatch_args, *separator, *fit_args],
                               env=env, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    assert record.read_text().splitlines() == [f"--array={array}", *sbatch_args, str(sweep), *fit_args]


@pytest.mark.parametrize("script", BATCH_SCRIPTS, ids=lambda p: p.name)
def test_the_launched_command_line_parses(script, tmp_path, capsys, monkeypatch):
    """Every option the script passes exists in `fit` and takes the value given (no typo reaches the
    cluster); --print_config parses without training."""
    environment = allocation_environment(2, 4, 4, SLURM_ARRAY_TASK_ID="5")
    status, stderr, srun_args = run_script(script, tmp_path, environment)
    assert status == 0, stderr
    fit_args = srun_args[srun_args.index("fl-lightning") + 1:]
    monkeypatch.chdir(REPOSITORY)  # the scripts run from the repository (--config is relative)
    with pytest.raises(SystemExit) as exited:
        fl_lightning_main([*fit_args, "--print_config"])
    assert exited.value.code in (None, 0), capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "devices: 4" in printed and "num_nodes: 2" in printed and "resume: auto" in printed
