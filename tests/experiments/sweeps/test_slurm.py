"""A plan submitted to SLURM: one array task per grid point (with a stand-in sbatch), and the fit a task resolves
its point to."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from commands import run_sweep
from sweeps import FL_LIGHTNING_BIN, TIMEOUT_S, stand_in_sbatch, write_plan

from fl_lightning.cli.arguments import expand_short_names
from fl_lightning.cli.parser import build_parser
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.plans.resolve import resolve_grid
from fl_lightning.experiments.sweeps.slurm import FIT_CONFIG_FILE, write_fit_config

pytestmark = pytest.mark.usefixtures("outside_slurm")  # a sweep here never submits or runs as a task


@pytest.mark.parametrize("options, sbatch_args", [
    ([], ["--array=0-3"]),
    (["--jobs", "3", "--gpus_per_run", "2", "--threads_per_run", "8", "--sbatch_options", "[--time=01:00:00]"],
     ["--array=0-3%3", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=4", "--time=01:00:00"]),
], ids=["plain", "resources"])
def test_slurm_submits_one_array_task_per_grid_point(options, sbatch_args, tmp_path, capsys, monkeypatch):
    record = stand_in_sbatch(tmp_path, monkeypatch)
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [], "FedProx": [{"algorithm": "fedprox"}]})
    runs = tmp_path / "runs"
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), "--slurm", "true", *options)
    assert status == 0, err
    assert record.read_text().splitlines() == [*sbatch_args, "slurm/sweep.sbatch", str(plan), "--runs_root",
                                               str(runs)]
    assert "4 grid points as one array job: sbatch" in out and "Submitted batch job 42" in out
    assert not runs.exists()  # nothing runs here


def test_fit_config_resolves_the_point_to_the_same_fit_call(tmp_path, monkeypatch):
    """What an array task launches (one config file, then the allocation's devices) is the point's fit."""
    monkeypatch.chdir(tmp_path)
    plan = write_plan(tmp_path / "plan.yaml", {"FedProx": [{"algorithm": "fedprox"}, {"algorithm.init_args.mu": 0.3}]},
                      seeds=[4])
    (resolved,) = resolve_grid(load_plan(plan, runs_root=Path("runs")).grid())
    point = resolved.point
    path = write_fit_config(resolved)
    assert path == point.out_dir / FIT_CONFIG_FILE and path.is_file()
    parser = build_parser()
    direct = parser.parse_args(expand_short_names(point.fit_arguments())).fit
    launched = parser.parse_args(["fit", "--config", str(path)]).fit
    direct.pop("config", None)
    launched.pop("config", None)
    assert launched == direct
    assert launched.out_dir == point.out_dir and launched.seed == 4 and launched.algorithm.init_args.mu == 0.3


def test_a_submission_whose_jobs_would_not_find_fl_lightning_is_refused(tmp_path, capsys, monkeypatch):
    """`.venv/bin/fl-lightning sweep ... --mode submit` with no environment active and FL_ACTIVATE unset:
    every task would fail in the queue (slurm/lib.sh's fl_activate), so nothing is submitted."""
    record = stand_in_sbatch(tmp_path, monkeypatch)
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": []})
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}/usr/bin:/bin")  # sbatch, bash, no fl-lightning
    submit = ["--plan", str(plan), "--runs_root", str(tmp_path / "runs"), "--mode", "submit"]
    for activate, got in ((None, "unset: fl-lightning is not on PATH in the job"),
                          ("false", "false: FL_ACTIVATE (false) failed with exit status 1")):
        if activate is not None:
            monkeypatch.setenv("FL_ACTIVATE", activate)
        status, out, err = run_sweep(capsys, *submit)
        assert status == 2 and "array job" not in out
        assert err.startswith("error: FL_ACTIVATE: expected a command that puts fl-lightning on PATH in the jobs (e.g. "
                              "FL_ACTIVATE='source ") and err.endswith(f", got '{got}'\n"), err
        assert not record.exists()
    monkeypatch.setenv("FL_ACTIVATE", f"export PATH={FL_LIGHTNING_BIN}:$PATH")
    status, out, err = run_sweep(capsys, *submit)
    assert status == 0 and "Submitted batch job 42" in out, err


@pytest.mark.multiprocess
def test_a_task_cancelled_while_it_resolves_its_point_exits_with_a_line(tmp_path, monkeypatch):
    """scancel of an array task while `--mode fit_config` starts: the task's shell, which reads the config's
    path, is gone, and its write finds no reader; one line says so, no traceback."""
    monkeypatch.chdir(tmp_path)
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": []}, seeds=[0])
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written: the write fails, whatever the timing
    try:
        completed = subprocess.run([sys.executable, "-m", "fl_lightning", "sweep", "--plan", str(plan), "--mode",
                                    "fit_config", "--index", "0"], stdout=write_end, stderr=subprocess.PIPE,
                                   text=True, timeout=TIMEOUT_S)
    finally:
        os.close(write_end)
    assert completed.returncode == 1
    assert completed.stderr == ("grid point 0: the job that asked for its settings (runs/smoke/alpha-0.5/fedavg/seed0/"
                                "sweep_fit.yaml) is gone (cancelled?); nothing to launch\n")
