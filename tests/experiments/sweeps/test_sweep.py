"""`fl-lightning sweep`: a plan's grid run locally (interrupted, rerun, with a failing method, by two
sweeps at once, closed by SIGHUP), its options, and the plan checked whole before anything runs or is
submitted (its points' settings, and run folders holding other experiments). Its progress, its
datasets, SLURM and the machine have their tests beside this file, named after their modules."""

import re
import signal

import processes
import pytest
from commands import run_sweep
from hand_written_runs import write_checkpoint
from sweeps import HOLD, TIMEOUT_S, files_of, finish, stand_in_sbatch, start_sweep, write_plan

from fl_lightning.checkpoint import checkpoint_dir
from fl_lightning.commands.main import main as fl_lightning_main
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.plans.resolve import resolve_grid
from fl_lightning.experiments.runs import LOG_FILE
from fl_lightning.experiments.sweeps import machine as machine_module
from fl_lightning.run_dir import RunDirLock
from fl_lightning.run_logging import read_metrics

pytestmark = pytest.mark.usefixtures("outside_slurm")  # a sweep here never submits or runs as a task


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
    write_checkpoint(resolved.point.out_dir, 2, resolved.config, final_stop="EarlyStopping: no improvement")
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs))
    assert status == 0, err
    assert f"[0] skipped, finished (round 2, stopped early): FedAvg | alpha-0.5 | seed 0 in {resolved.point.out_dir}" \
        in out
    assert out.splitlines()[-1] == "0 finished, 0 failed, 1 skipped"
    assert not (resolved.point.out_dir / LOG_FILE).exists()  # no process started
    status, out, _ = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), "--list")
    assert "finished, stopped early at round 2/3" in out.splitlines()[1]
