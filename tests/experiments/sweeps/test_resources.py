"""A plan's `resources:` (GPUs per run, precision, time per run) as a sweep honours it: the sweep's
defaults locally and with --slurm, a GPU plan refused where its runs would train on the CPU unless the
command line says so, and the shipped GPU plan states them. The suite has no GPU: every GPU run here
is a dry run or a refusal."""

import os
from pathlib import Path

import pytest
import yaml
from commands import run_sweep
from paths import QUICKSTART, REPOSITORY
from sweeps import jobs_find_fl_lightning

from fl_lightning.experiments.plans.plan import load_plan

TINY = {"model.options": {"hidden": 16, "depth": 1}, "federation.rounds": 2, "federation.local_steps": 1,
        "logger.wandb_mode": "disabled"}
GPU_RESOURCES = {"gpus_per_run": 2, "precision": "bf16-mixed", "time_per_run": "02:00:00", "cpus_per_run": 8}
# What sinfo --format="%P %G" prints for a cluster whose default partition has no GPUs.
PARTITIONS = "cpu* (null)\ngpu gpu:a100:4(S:0-1)\ngpu gpu:a100:8(S:0-3)\nbig (null)\n"


@pytest.fixture(autouse=True)
def no_gpu_and_outside_slurm(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, on any machine
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)


def write_plan(path: Path, resources=None, configs=(), methods=None) -> Path:
    plan = {"name": "gpuplan", "configs": [QUICKSTART, TINY, *configs],
            "methods": methods or {"FedAvg": [{"algorithm": "fedavg"}]},
            "settings": {"alpha": {"0.5": [{"data.alpha": 0.5}]}}, "seeds": [0]}
    if resources is not None:
        plan["resources"] = resources
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


@pytest.fixture
def at_repository_root(monkeypatch):
    monkeypatch.chdir(REPOSITORY)  # --slurm submits from the repository root (slurm/sweep.sbatch)
    jobs_find_fl_lightning(monkeypatch)  # what a submission checks its jobs will find


def test_a_gpu_plan_is_refused_locally_without_gpus(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", GPU_RESOURCES)
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(tmp_path / "runs"), "--dry_run")
    assert status == 2 and "[0]" not in out
    assert err.startswith("error: gpus_per_run: expected GPUs visible here for plan gpuplan, whose resources ask "
                          "for 2 per run"), err
    assert "give --gpus_per_run 0 to train its runs on the CPU anyway, got '2 (plan.resources.gpus_per_run)'" in err


def test_gpus_per_run_0_on_the_command_line_overrides_the_plan_and_says_so(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", GPU_RESOURCES)
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(tmp_path / "runs"), "--dry_run",
                                 "--gpus_per_run", "0")
    assert status == 0, err
    assert "note: --gpus_per_run 0 overrides the plan's resources.gpus_per_run: 2 (its runs train on the CPU)" in out
    command = next(line for line in out.splitlines() if line.startswith("[0]"))
    # The plan's precision comes first (a default every config may state again), the CPU last.
    assert " fit --fabric.precision bf16-mixed --config " in command
    assert command.endswith("--fabric.accelerator cpu --fabric.devices 1 --fabric.num_nodes 1 "
                            "--logger.progress_bar false")


@pytest.mark.slow
def test_with_slurm_the_plans_resources_are_the_array_jobs(tmp_path, capsys, at_repository_root):
    plan = write_plan(tmp_path / "plan.yaml", GPU_RESOURCES)
    runs = str(tmp_path / "runs")
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", runs, "--slurm", "--dry_run",
                                 "--sbatch_options", "[--partition=gpu]")
    assert status == 0, err
    assert (f"1 grid points as one array job: sbatch --array=0-0 --ntasks-per-node=2 --gpus-per-node=2 "
            f"--cpus-per-task=4 --time=02:00:00 --partition=gpu slurm/sweep.sbatch {plan} --runs_root {runs}") in out
    # The command line's own --time, --gpus_per_run and --threads_per_run win, and say what they override.
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", runs, "--slurm", "--dry_run",
                                 "--sbatch_options", "[--time=00:30:00]", "--gpus_per_run", "1",
                                 "--threads_per_run", "2")
    assert status == 0, err
    assert "note: --gpus_per_run 1 overrides the plan's resources.gpus_per_run: 2" in out
    assert "note: --time=00:30:00 (--sbatch_options) overrides the plan's resources.time_per_run: 02:00:00" in out
    assert ("sbatch --array=0-0 --ntasks-per-node=1 --gpus-per-node=1 --cpus-per-task=2 --time=00:30:00 "
            "slurm/sweep.sbatch " in out)


@pytest.mark.slow
def test_a_plan_whose_configs_ask_for_gpus_is_refused_without_resources(tmp_path, capsys, at_repository_root):
    plan = write_plan(tmp_path / "plan.yaml", configs=[{"fabric.accelerator": "gpu"}])
    runs = str(tmp_path / "runs")
    for where in (["--slurm"], []):
        status, out, err = run_sweep(capsys, str(plan), "--runs_root", runs, "--dry_run", *where)
        assert status == 2 and "array job" not in out
        assert err.startswith("error: gpus_per_run: expected GPUs for plan gpuplan, whose runs ask for them "
                              "(fabric.accelerator gpu in the settings of 1 grid point(s), first [0])"), err
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", runs, "--dry_run", "--slurm", "--gpus_per_run", "0")
    assert status == 0, err
    assert "note: --gpus_per_run 0 runs on the CPU the 1 run(s) whose settings ask for fabric.accelerator gpu" in out
    assert "sbatch --array=0-0 slurm/sweep.sbatch" in out


@pytest.mark.slow
def test_a_config_setting_another_precision_than_the_resources_is_refused(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", {"precision": "bf16-mixed"},
                      methods={"FedAvg": [{"algorithm": "fedavg"}],
                               "FedAvg fp32": [{"algorithm": "fedavg"}, {"fabric.precision": "32-true"}]})
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(tmp_path / "runs"), "--dry_run")
    assert status == 2
    assert err.splitlines() == [
        "error: plan.resources.precision: expected the precision of every grid point (bf16-mixed; a config that "
        f"sets fabric.precision disagrees with it), got {plan}, where",
        "  [1] FedAvg fp32 | alpha-0.5 | seed 0: fabric.precision 32-true"]
    # An override of the precision is every point's, the resources' included (where no method sets it:
    # FedAvg fp32 would then be FedAvg, and the override is refused; see tests/experiments/plans/test_overrides.py).
    plan = write_plan(tmp_path / "plan.yaml", {"precision": "bf16-mixed"})
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(tmp_path / "runs"), "--dry_run",
                                 "--override", "fabric.precision=32-true")
    assert status == 0, err
    assert all("--fabric.precision 32-true --out_dir" in line
               for line in out.splitlines() if line.startswith("["))


@pytest.mark.parametrize("name, resources", [
    ("ctpfl_table1", (4, "bf16-mixed", "24:00:00", None)),
    ("fedconst_table1_resnet18_cross-device", (1, None, "24:00:00", 4)),
    ("fedconst_table1_resnet18_cross-silo", (1, None, "24:00:00", 4)),
])
def test_the_shipped_gpu_plans_state_their_resources(name, resources, monkeypatch):
    monkeypatch.chdir(REPOSITORY)
    plan = load_plan(REPOSITORY / "configs" / "plans" / f"{name}.yaml")
    stated = plan.resources
    assert (stated.gpus_per_run, stated.precision, stated.time_per_run, stated.cpus_per_run) == resources
    if stated.precision is not None:
        assert plan.grid()[0].parts[0] == {"fabric.precision": "bf16-mixed"}


def stand_in(tmp_path: Path, monkeypatch, name: str, script: str) -> None:
    """`name` on PATH as a bash script (sinfo, sbatch) in the test's bin/."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/bash\n{script}\n")
    (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.slow
def test_gpus_asked_of_a_partition_without_gpus_are_refused_before_sbatch(tmp_path, capsys, monkeypatch,
                                                                         at_repository_root):
    stand_in(tmp_path, monkeypatch, "sinfo", f'[[ $* == "--noheader --format=%P %G" ]] && printf "{PARTITIONS}"')
    stand_in(tmp_path, monkeypatch, "sbatch", f'echo "$@" > {tmp_path}/sbatch_args.txt; echo "Submitted batch job 7"')
    plan = write_plan(tmp_path / "plan.yaml", GPU_RESOURCES)
    runs = str(tmp_path / "runs")
    for dry_run in (["--dry_run"], []):
        status, out, err = run_sweep(capsys, str(plan), "--runs_root", runs, "--slurm", *dry_run)
        assert status == 2 and "array job" not in out
        assert err == ("error: gpus_per_run: expected a partition with GPUs for plan gpuplan's 2 GPU(s) per run: sinfo "
                       "reports no GPU (gres) in partition cpu (the default); give --sbatch_options "
                       '"[--partition=gpu]", or --gpus_per_run 0 to train its runs on the CPU, got 2\n')
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", runs, "--slurm", "--sbatch_options", "[-p, big]")
    assert status == 2 and "no GPU (gres) in partition big; give" in err
    assert not (tmp_path / "sbatch_args.txt").exists()
    # A partition with GPUs, or the runs on the CPU on purpose, is submitted.
    for options in (["--sbatch_options", "[--partition=gpu]"], ["--gpus_per_run", "0"]):
        status, out, err = run_sweep(capsys, str(plan), "--runs_root", runs, "--slurm", *options)
        assert status == 0 and "Submitted batch job 7" in out, err


@pytest.mark.slow
def test_where_sinfo_does_not_answer_sbatchs_gres_refusal_names_the_way_out(tmp_path, capsys, monkeypatch,
                                                                           at_repository_root):
    stand_in(tmp_path, monkeypatch, "sinfo", "echo 'slurm_load_partitions: Unable to contact slurm controller' >&2; "
             "exit 1")
    stand_in(tmp_path, monkeypatch, "sbatch", "echo 'sbatch: error: Batch job submission failed: Invalid generic "
             "resource (gres) specification' >&2; exit 1")
    plan = write_plan(tmp_path / "plan.yaml", GPU_RESOURCES)
    status, out, err = run_sweep(capsys, str(plan), "--runs_root", str(tmp_path / "runs"), "--slurm")
    assert status == 1
    assert err.splitlines() == [
        "error: sbatch exited 1: sbatch: error: Batch job submission failed: Invalid generic resource (gres) "
        "specification",
        'the cluster gives no GPUs where the tasks ask for 2 each: choose a partition with GPUs (--sbatch_options '
        '"[--partition=NAME]"; sinfo -o "%P %G" lists them), or give --gpus_per_run 0 to train the runs on the CPU']
