"""`fl-lightning sweep`: a plan's grid run locally (interrupted, rerun, with a failing method, by two
sweeps at once, closed by SIGHUP), listed, checked whole before anything runs (its points' settings,
and run folders holding other experiments), and submitted to SLURM as one array job (with a stand-in
sbatch); how runs share the machine."""

import os
import re
import signal
import sys
from pathlib import Path

import holds
import processes
import pytest
import yaml
from commands import run_sweep

from fl_lightning.checkpoint import FINAL_STOP, checkpoint_dir, save_checkpoint
from fl_lightning.cli.arguments import expand_short_names
from fl_lightning.cli.parser import build_parser
from fl_lightning.commands.main import main as fl_lightning_main
from fl_lightning.data import datasets
from fl_lightning.data.datasets import check_dataset
from fl_lightning.errors import ConfigError
from fl_lightning.experiments import data_check
from fl_lightning.experiments import local as local_module
from fl_lightning.experiments import machine as machine_module
from fl_lightning.experiments import progress as progress_module
from fl_lightning.experiments.local import LOG_FILE, run_environment
from fl_lightning.experiments.machine import plan_resources
from fl_lightning.experiments.plan import load_plan
from fl_lightning.experiments.progress import ProgressLines
from fl_lightning.experiments.resolve import resolve_grid
from fl_lightning.experiments.slurm import FIT_CONFIG_FILE, write_fit_config
from fl_lightning.run_dir import RunDirLock
from fl_lightning.run_logging import MetricsLog, read_metrics

REPOSITORY = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPOSITORY / "configs" / "quickstart.yaml")
ROUNDS = 3
TINY = {"model.options": {"hidden": 16, "depth": 1}, "federation.rounds": ROUNDS, "federation.local_steps": 2,
        "checkpoint.every": 1, "logger.wandb_mode": "disabled"}
TIMEOUT_S = 120

# Holds a run after round 1 (its checkpoint written) while its run folder has a file `hold`, until the
# run is asked to stop: the sweep is interrupted at a known point, whatever the machine's speed.
HOLD = {"callbacks": [holds.hold_after(1)]}


@pytest.fixture
def gate(tmp_path, monkeypatch) -> None:
    """HOLD importable in the runs the sweep starts (this process has the tests folder on sys.path),
    with the test's folder as the working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", holds.pythonpath())


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch):
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)


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


@pytest.mark.slow
def test_interrupted_sweep_resumes_without_retraining_finished_runs(tmp_path, capsys, gate, forked_runs):
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [{"algorithm": "fedavg"}],
                                               "FedProx": [{"algorithm": "fedprox"}]}, seeds=[0], extra=[HOLD])
    runs = tmp_path / "runs"
    points = load_plan(plan, runs_root=runs).grid()
    assert [(p.method, p.seed) for p in points] == [("FedAvg", 0), ("FedProx", 0)]
    finished, held = points[0], points[1]

    # One at a time (a machine of one core takes no more): FedAvg finishes, then FedProx is held after
    # round 1 until the sweep gets Ctrl-C, which it passes on as SIGTERM. The sweep is a process of its
    # own, as from a shell.
    held.out_dir.mkdir(parents=True)
    (held.out_dir / "hold").touch()
    process, output, errors = start_sweep(tmp_path, "sweep", "--plan", str(plan), "--runs_root", str(runs))
    try:
        processes.wait_until(lambda: "[0] finished at round 3" in output.read_text()
                             and (checkpoint_dir(held.out_dir) / "round_000001.ckpt").exists()
                             and "running [1] round 1/3" in output.read_text(), [process],
                             "FedAvg finished, FedProx checkpointed round 1 and the sweep said so", TIMEOUT_S)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    out, err = output.read_text(), errors.read_text()
    assert process.returncode == 130, err
    # Its progress, a line when a run logged its first round: FedProx's, held after it.
    assert "\nprogress: 1/2 runs finished; running [1] round 1/3 (" in out
    assert "SIGINT: asking 1 run(s) to checkpoint and stop at the end of their round" in err
    assert "[1] stopped at round 2" in out
    assert out.splitlines()[-1] == "1 finished, 0 failed, 0 skipped, 1 stopped, 0 not started"
    assert "interrupted by SIGINT: run the same command again to continue" in err

    # --list reads each run folder's state, training nothing.
    status, out, _ = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), "--list", "true")
    assert status == 0
    rows = out.splitlines()
    assert rows[0].split() == ["index", "method", "setting", "seed", "state", "run", "folder", "round", "left"]
    for point, row in zip(points, rows[1:3]):
        assert row.split()[:4] == [str(point.index), point.method, "alpha-0.5", str(point.seed)]
        assert f"  {point.out_dir}  " in row
    assert re.split(r"\s{2,}", rows[1])[4:] == ["finished", str(points[0].out_dir), "3/3", "-"]
    assert re.split(r"\s{2,}", rows[2])[4:7] == ["partial at round 2/3", str(points[1].out_dir), "2/3"]
    assert rows[3] == "2 runs: 1 finished, 1 partial, 0 without a checkpoint"
    before = files_of(finished.out_dir)

    # The same command again (in this process, its run forked): the finished run is skipped (no
    # process, no file touched), the stopped one continues from its checkpoint.
    (held.out_dir / "hold").unlink()
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs))
    assert status == 0, err
    assert f"[{finished.index}] skipped, finished (round 3)" in out
    assert out.splitlines()[-1] == "1 finished, 0 failed, 1 skipped"
    assert files_of(finished.out_dir) == before
    assert [row["round"] for row in read_metrics(held.out_dir)] == [1, 2, 3]
    log = (held.out_dir / LOG_FILE).read_text()
    assert log.count("=== ") == 2 and "resuming from" in log and "--fabric.devices 1" in log

    # One point in the foreground: finished, so nothing runs.
    status, out, _ = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), "--index", "1")
    assert status == 0 and "[1] skipped, finished" in out and out.splitlines()[-1] == "0 finished, 0 failed, 1 skipped"


def finish(process: processes.Popen) -> int:
    try:
        return process.wait(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_sweeps_of_one_plan_split_the_grid(tmp_path, capsys, gate, forked_runs):
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [{"algorithm": "fedavg"}]}, extra=[HOLD])
    runs = tmp_path / "runs"
    held, other = load_plan(plan, runs_root=runs).grid()
    held.out_dir.mkdir(parents=True)
    (held.out_dir / "hold").touch()
    options = ("--plan", str(plan), "--runs_root", str(runs))
    first, first_out, first_err = start_sweep(tmp_path, "first", *options)
    try:
        processes.wait_until(lambda: (checkpoint_dir(held.out_dir) / "round_000001.ckpt").exists(), [first],
                             "the first sweep's run of seed 0 checkpointed round 1", TIMEOUT_S)
        # While the first sweep's run of seed 0 is held, a second sweep (in this process, its run
        # forked) takes seed 1.
        status, out, err = run_sweep(capsys, *options)
        assert status == 0, err
        assert f"[0] skipped, running elsewhere (held by pid {first.pid} on " in out
        assert "[1] finished at round 3" in out
        assert out.splitlines()[-1] == "1 finished, 0 failed, 0 skipped, 1 running elsewhere"
        (held.out_dir / "hold").unlink()
        assert finish(first) == 0, first_err.read_text()
    finally:
        if first.poll() is None:
            first.kill()
    out = first_out.read_text()
    assert "[0] finished at round 3" in out and "[1] skipped, finished (round 3) elsewhere" in out
    assert out.splitlines()[-1] == "1 finished, 0 failed, 1 skipped"
    for point in (held, other):
        assert [row["round"] for row in read_metrics(point.out_dir)] == [1, 2, 3]
        assert (point.out_dir / LOG_FILE).read_text().count("=== ") == 1  # one sweep wrote each log


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sighup_stops_the_runs_at_a_round_boundary_and_leaves_none_training(tmp_path, gate):
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [{"algorithm": "fedavg"}]}, seeds=[0], extra=[HOLD])
    runs = tmp_path / "runs"
    (point,) = load_plan(plan, runs_root=runs).grid()
    point.out_dir.mkdir(parents=True)
    (point.out_dir / "hold").touch()
    # Its run a fresh interpreter in a session of its own, as the sweep starts runs for users: the one
    # test of a sweep whose run the product starts itself.
    process, output, errors = start_sweep(tmp_path, "sweep", "--plan", str(plan), "--runs_root", str(runs),
                                          fresh_runs=True)
    try:
        processes.wait_until(lambda: (checkpoint_dir(point.out_dir) / "round_000001.ckpt").exists(), [process],
                             "the run checkpointed round 1", TIMEOUT_S)
        process.send_signal(signal.SIGHUP)  # the terminal closed
        assert finish(process) == 128 + signal.SIGHUP, errors.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    assert "SIGHUP: asking 1 run(s) to checkpoint and stop at the end of their round" in errors.read_text()
    assert "[0] stopped at round 2" in output.read_text()
    assert [row["round"] for row in read_metrics(point.out_dir)] == [1, 2]
    lock = RunDirLock(point.out_dir)
    lock.acquire()  # no process holds the run: none was left training
    lock.release()


@pytest.mark.slow
def test_a_failing_method_is_reported_and_the_others_finish(tmp_path, capsys, monkeypatch, forked_runs):
    monkeypatch.chdir(tmp_path)
    # A batch larger than every client: fit refuses it once the data is split (exit status 2), which
    # no check of the settings alone can tell beforehand.
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [], "Broken": [{"federation.batch_size": 100000}]},
                      seeds=[0], settings={})
    runs = tmp_path / "runs"
    monkeypatch.setattr(machine_module, "available_cores", lambda: 2)  # two runs at once, on any machine
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--jobs", "2", "--runs_root", str(runs))
    assert status == 1
    broken = runs / "smoke" / "default" / "broken" / "seed0"
    assert f"[1] FAILED with exit status 2: Broken | default | seed 0 in {broken}" in err
    assert f"last lines of {broken / LOG_FILE}:" in err
    assert "| error: federation.batch_size: expected at most the largest client's number of samples" in err
    assert "[0] finished at round 3" in out
    assert out.splitlines()[-1] == "1 finished, 1 failed, 0 skipped"
    assert [row["round"] for row in read_metrics(runs / "smoke" / "default" / "fedavg" / "seed0")] == [1, 2, 3]


def test_bad_sweep_options_are_refused(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": []})
    for arguments, message in [
        (["--index", "2"], "error: index: expected a grid point of"),
        (["--mode", "fit_config"], "error: index: expected the grid point whose settings --mode fit_config writes"),
        (["--fit_config", "true"], "error: index: expected the grid point whose settings --mode fit_config writes"),
        (["--mode", "submit", "--index", "0"],
         "error: index: expected unset with --mode submit, which takes --jobs, --gpus_per_run, --threads_per_run, "
         "--sbatch_options, --dry_run"),
        (["--slurm", "true", "--index", "0"], "error: index: expected unset with --mode submit"),
        (["--mode", "list", "--jobs", "2"], "error: jobs: expected unset with --mode list, which takes no option"),
        (["--list", "true", "--estimate", "true"], "error: mode: expected one mode (--mode, or one of --list, "
                                                   "--estimate, --slurm, --fit_config), got ['estimate', 'list']"),
        (["--mode", "walk"], "error: mode: expected one of run, list, estimate, submit, fit_config"),
    ]:
        status, _, err = run_sweep(capsys, "--plan", str(plan), *arguments)
        assert status == 2 and message in err, err


# --- SLURM ---------------------------------------------------------------------------------------

def stand_in_sbatch(tmp_path: Path, monkeypatch) -> Path:
    record = tmp_path / "sbatch_args.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {record}\necho "Submitted batch job 42"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(REPOSITORY)  # jobs are submitted from the repository root
    return record


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


@pytest.mark.parametrize("where", [[], ["--slurm", "true"]], ids=["locally", "slurm"])
def test_a_plan_with_a_refused_point_is_refused_whole_before_anything_runs(where, tmp_path, capsys, monkeypatch):
    record = stand_in_sbatch(tmp_path, monkeypatch)
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [], "FedProx": [{"algorithm": "fedprox"},
                                                                        {"algorithm.init_args.mu": -1}]})
    runs = tmp_path / "runs"
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), *where)
    assert status == 2 and out == ""
    assert err.splitlines() == [
        f"error: plan: expected grid points whose settings fit accepts (every point is checked before any run "
        f"starts; 2 of 4 are refused), got {plan}, where",
        *(f"  [{index}] FedProx | alpha-0.5 | seed {seed}: algorithm.init_args.mu: expected a value >= 0, got -1.0"
          for index, seed in ((2, 0), (3, 1)))]
    assert not record.exists() and not runs.exists()  # nothing submitted, nothing run


def dataset_settings(tmp_path: Path) -> dict:
    """Two datasets, neither there: CIFAR-10 with no folder, CIFAR-100 with its train file only."""
    (tmp_path / "partial" / "cifar-100-python").mkdir(parents=True)
    (tmp_path / "partial" / "cifar-100-python" / "train").write_bytes(b"")
    return {"dataset": {"cifar10": [{"data.name": "cifar10", "data.root": str(tmp_path / "nothing")}],
                        "cifar100": [{"data.name": "cifar100", "data.root": str(tmp_path / "partial")}]}}


@pytest.mark.parametrize("where", [[], ["--slurm"], ["--estimate"]], ids=["locally", "slurm", "estimate"])
def test_a_missing_or_partial_dataset_is_refused_before_anything_runs_or_is_submitted(where, tmp_path, capsys,
                                                                                     monkeypatch):
    record = stand_in_sbatch(tmp_path, monkeypatch)
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [], "FedProx": [{"algorithm": "fedprox"}]},
                      settings=dataset_settings(tmp_path))
    runs = tmp_path / "runs"
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), *where)
    assert status == 2 and "timed" not in out and "array job" not in out
    assert err.splitlines() == [
        "error: data.root: expected the dataset of every grid point in its layout under its data.root before anything "
        "runs or is submitted (put it there, fetch it with fl-lightning data, or set data.download: true where the "
        f"runs can reach the network), got {plan}, where",
        "  cifar10 for 4 point(s), first [0] FedAvg | dataset-cifar10 | seed 0: data.root: expected "
        f"{tmp_path}/nothing/cifar-10-batches-py/ to hold data_batch_1..5 and test_batch (CIFAR-10, python version) "
        f"(or set data.download: true), got '{tmp_path}/nothing'",
        f"  cifar100 for 4 point(s), first [4] FedAvg | dataset-cifar100 | seed 0: data.root: expected "
        f"{tmp_path}/partial/cifar-100-python/ to hold train and test (CIFAR-100, python version), got "
        f"'{tmp_path}/partial, whose cifar-100-python/ lacks test'"]
    assert not record.exists() and not runs.exists()  # nothing submitted, nothing run


def test_each_dataset_folder_is_checked_once_reading_none_of_it_and_a_download_may_fetch_it(
        tmp_path, capsys, monkeypatch, cifar_root):
    record = stand_in_sbatch(tmp_path, monkeypatch)
    checked = []
    monkeypatch.setattr(data_check, "check_dataset", lambda name, root, download: checked.append(
        (name, str(root), download)) or check_dataset(name, root, download))
    monkeypatch.setattr(datasets, "_read_cifar_batch", None)  # no point's data is read
    settings = dataset_settings(tmp_path)
    settings["dataset"]["cifar10"][0]["data.root"] = str(cifar_root)
    settings["dataset"]["cifar100"][0].update({"data.root": str(tmp_path / "empty"), "data.download": True})
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [], "FedProx": [{"algorithm": "fedprox"}]},
                      settings=settings)
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(tmp_path / "runs"), "--slurm")
    assert status == 0, err
    assert "Submitted batch job 42" in out and record.exists()
    # Absent, CIFAR-100 is allowed: its runs fetch it.
    assert checked == [("cifar10", str(cifar_root), False), ("cifar100", str(tmp_path / "empty"), True)]


@pytest.mark.slow
def test_run_folders_of_another_experiment_are_refused_before_anything_runs_and_left_out_of_the_table(
        tmp_path, capsys, monkeypatch, forked_runs):
    monkeypatch.chdir(tmp_path)
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [{"algorithm": "fedavg"}]})
    runs = tmp_path / "runs"
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), "--index", "0")
    assert status == 0, err
    first, second = load_plan(plan, runs_root=runs).grid()
    # The plan's alpha is changed after its first run: that run is another experiment now.
    plan.write_text(plan.read_text().replace("data.alpha: 0.5", "data.alpha: 0.1"))
    before = files_of(first.out_dir)
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs))
    assert status == 2 and out == ""
    assert err.splitlines() == [
        "error: out_dir: expected run folders that hold this plan's experiments or nothing (1 hold runs made with "
        "other settings: move each away, or give the plan its settings back, then run the same command again), "
        f"got {plan}, where",
        f"  [0] FedAvg | alpha-0.5 | seed 0 in {first.out_dir}: data.alpha 0.5 -> 0.1 (the checkpoint of round 3)"]
    assert files_of(first.out_dir) == before and not second.out_dir.exists()
    status, out, _ = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), "--list")
    assert "another experiment: data.alpha 0.5 -> 0.1 (the checkpoint of round 3)" in out.splitlines()[1]

    capsys.readouterr()
    fl_lightning_main(["table", str(plan), "--runs_root", str(runs)])
    out = capsys.readouterr().out
    assert "| FedAvg | – |" in out
    assert ("not counted, made with other settings than the plan's (rerun them in folders of their own): "
            "alpha-0.5/FedAvg/seed0 (data.alpha 0.5 -> 0.1 (config.yaml))") in out


def test_an_early_stopped_run_is_finished_and_skipped(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [{"algorithm": "fedavg"}]}, seeds=[0])
    runs = tmp_path / "runs"
    (resolved,) = resolve_grid(load_plan(plan, runs_root=runs).grid())
    # The checkpoint an early stop at round 2 of 3 leaves: the run is over.
    state = {"round": 2, "model": {}, "algorithm": {}, "partition": [], "metrics": [],
             "hyperparameters": resolved.config, FINAL_STOP: "EarlyStopping: no improvement"}
    save_checkpoint(state, resolved.point.out_dir, keep=1)
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs))
    assert status == 0, err
    assert f"[0] skipped, finished (round 2, stopped early): FedAvg | alpha-0.5 | seed 0 in {resolved.point.out_dir}" \
        in out
    assert out.splitlines()[-1] == "0 finished, 0 failed, 1 skipped"
    assert not (resolved.point.out_dir / LOG_FILE).exists()  # no process started
    status, out, _ = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), "--list")
    assert "finished, stopped early at round 2/3" in out.splitlines()[1]


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


# --- progress ------------------------------------------------------------------------------------

def log_rounds(out_dir: Path, seconds: list[float]) -> None:
    """metrics.jsonl of a run that trained rounds of these round_seconds, as the run writes it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    MetricsLog(out_dir, [{"round": number, "train_loss": 1.0, "round_seconds": value}
                         for number, value in enumerate(seconds, start=1)])


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_local_sweeps_progress_is_a_line_at_a_time_with_the_time_left(tmp_path):
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [], "FedProx": [{"algorithm": "fedprox"}]}, seeds=[0, 1])
    points = load_plan(plan, runs_root=tmp_path / "runs").grid()
    rounds = {point.index: 10 for point in points}
    clock = Clock()
    progress = ProgressLines(rounds, {point.index: 0 for point in points}, jobs=2, total=4, clock=clock)
    running, pending = points[:2], points[2:]
    assert progress.line(running, pending, finished=0, failed=0) is None  # no round yet
    # The first round of a run is said at once: its pace (after the first, warm-up, round) gives the
    # time it has left, and, for runs of its method yet to start, theirs.
    log_rounds(points[0].out_dir, [9.0, 2.0, 4.0])
    clock.now += 1
    assert progress.line(running, pending, 0, 0) == (
        "progress: 0/4 runs finished; running [0] round 3/10 (21 s left), [1] round 0/10 (- left); the sweep: "
        # [0] 7 x 3 s and [1] 10 x 3 s (FedAvg's pace); FedProx's runs, at the only pace there is: 20 x 3 s
        f"{(7 + 10 + 20) * 3 / 2:.0f} s left")
    # More rounds: a line when PROGRESS_SECONDS have passed, not before (nor without a new round).
    log_rounds(points[0].out_dir, [9.0, 2.0, 4.0, 3.0])
    clock.now += 1
    assert progress.line(running, pending, 0, 0) is None
    clock.now += progress_module.PROGRESS_SECONDS
    assert progress.line(running, pending, 0, 0).startswith("progress: 0/4 runs finished; running [0] round 4/10 ")
    clock.now += progress_module.PROGRESS_SECONDS
    assert progress.line(running, pending, 0, 0) is None
    # [0] finished, [1] failed: the sweep's time left is its pending runs'.
    log_rounds(points[2].out_dir, [5.0, 8.0])
    clock.now += 1
    assert progress.line(points[2:3], points[3:], finished=1, failed=1) == (
        "progress: 1/4 runs finished, 1 failed; running [2] round 2/10 (64 s left); the sweep: "
        f"{(8 * 8 + 10 * 8) / 2:.0f} s left")


def test_list_shows_each_runs_round_and_time_left_from_its_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [{"algorithm": "fedavg"}]}, seeds=[0, 1, 2])
    runs = tmp_path / "runs"
    first, second, third = resolve_grid(load_plan(plan, runs_root=runs).grid())
    # As SLURM tasks leave them: [0] finished, [1] checkpointed round 1 and logged round 2 since.
    for entry, checkpointed, seconds in ((first, 3, [1.0, 2.0, 2.0]), (second, 1, [3.0, 4.0])):
        out_dir = entry.point.out_dir
        save_checkpoint({"round": checkpointed, "model": {}, "algorithm": {}, "partition": [], "metrics": [],
                         "hyperparameters": entry.config}, out_dir, keep=1)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(entry.config))
        log_rounds(out_dir, seconds)
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), "--list")
    assert status == 0, err
    rows = [re.split(r"\s{2,}", line)[4:] for line in out.splitlines()]
    assert rows[1] == ["finished", str(first.point.out_dir), "3/3", "-"]
    assert rows[2] == ["partial at round 1/3", str(second.point.out_dir), "2/3", "4 s"]  # 1 round left at 4 s
    assert rows[3] == ["not started", str(third.point.out_dir), "-", "-"]
    # [1]'s round and [2]'s three at FedAvg's pace (4 s, and 2 s): 1 x 4 + 3 x 3
    assert out.splitlines()[-1] == ("training left: about 13 s one run at a time, at the pace of the rounds logged "
                                    "by 2 run(s) (a run not started yet at its method's)")


# --- sharing the machine -------------------------------------------------------------------------

def test_cpu_runs_share_the_cores(monkeypatch):
    monkeypatch.setattr(machine_module, "available_cores", lambda: 8)
    assert plan_resources(jobs=2, gpus_per_run=0, threads_per_run=None).threads == 4
    assert plan_resources(jobs=3, gpus_per_run=0, threads_per_run=None).threads == 2
    assert plan_resources(jobs=1, gpus_per_run=0, threads_per_run=3).threads == 3
    with pytest.raises(ConfigError) as refused:
        plan_resources(jobs=2, gpus_per_run=0, threads_per_run=5)
    assert refused.value.field_name == "threads_per_run"
    with pytest.raises(ConfigError) as refused:
        plan_resources(jobs=9, gpus_per_run=0, threads_per_run=None)
    assert refused.value.field_name == "jobs"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="binds processes to CPUs (Linux)")
def test_cpu_runs_are_bound_to_cpus_of_their_own(tmp_path, monkeypatch):
    """Each run of a CPU sweep gets CPUs of its own, and chooses its threads from them (fl_lightning.cpu):
    the sweep gives it no thread count. Where there are fewer CPUs than counted, OMP_NUM_THREADS."""
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    resources = plan_resources(jobs=len(cpus), gpus_per_run=0, threads_per_run=None)
    assert resources.cpu_slots == [[cpu] for cpu in cpus]
    environment = run_environment(resources, len(cpus) - 1)
    assert "OMP_NUM_THREADS" not in environment and "MKL_NUM_THREADS" not in environment
    with open(tmp_path / "log", "wb") as log:
        process = local_module.start_run_process(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], environment, log,
            resources.cpu_slots[-1])
        assert process.wait(timeout=60) == 0
    assert (tmp_path / "log").read_text().strip() == str([cpus[-1]])

    monkeypatch.setattr(machine_module, "available_cores", lambda: 2 * len(cpus))
    resources = plan_resources(jobs=2, gpus_per_run=0, threads_per_run=None)
    assert resources.cpu_slots is None
    assert run_environment(resources, 0)["OMP_NUM_THREADS"] == str(len(cpus))


def test_gpu_runs_get_gpus_of_their_own(monkeypatch):
    monkeypatch.setattr(machine_module, "available_cores", lambda: 16)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("LOCAL_RANK", "2")
    resources = plan_resources(jobs=2, gpus_per_run=2, threads_per_run=None)
    assert (resources.accelerator, resources.devices, resources.threads) == ("gpu", 2, 4)
    environments = [run_environment(resources, slot) for slot in (0, 1)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in environments] == ["3,5", "6,7"]
    assert all(e["OMP_NUM_THREADS"] == "4" and "SLURM_JOB_ID" not in e and "LOCAL_RANK" not in e
               for e in environments)
    for jobs, gpus_per_run, field_name in [(3, 2, "jobs"), (1, 5, "gpus_per_run")]:
        with pytest.raises(ConfigError) as refused:
            plan_resources(jobs=jobs, gpus_per_run=gpus_per_run, threads_per_run=None)
        assert refused.value.field_name == field_name
