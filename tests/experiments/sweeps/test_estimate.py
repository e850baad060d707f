"""`fl-lightning sweep PLAN --mode estimate`: the kinds of local step a grid is timed at (the smoke plan's
two, a method's hyper-parameter values no kind of their own), a method that computes more per step
priced above FedAvg (by the CPU time of its steps, measured in one process), a point's work per round
and its checkpoints against a real run of it, the client state of a stateful method at the plan's
clients, GPU-hours, the note on a busy machine, and Ctrl-C."""

import json
import os
import re
import signal
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from commands import run_sweep
from paths import REPOSITORY

from fl_lightning import cpu
from fl_lightning.checkpoint import checkpoint_dir, numbered_checkpoints
from fl_lightning.clients.run import CLIENT_STREAM, batch_positions, seeded_generator
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.plans.resolve import resolve_grid
from fl_lightning.experiments.plans.tuning import TunedGrid
from fl_lightning.experiments.sweeps import estimate as estimate_module
from fl_lightning.experiments.sweeps import step_costs
from fl_lightning.experiments.sweeps.estimate import PricedPoint, group_by_kind, machine_note
from fl_lightning.experiments.sweeps.machine import Resources
from fl_lightning.experiments.sweeps.step_costs import StepCost, Stretch
from fl_lightning.federation.aggregation import sample_clients
from fl_lightning.models import create_model
from fl_lightning.run_logging import MetricsLog

SMOKE = REPOSITORY / "configs" / "plans" / "smoke.yaml"
UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}
ONE_THREAD = ["--threads_per_run", "1"]
pytestmark = pytest.mark.usefixtures("in_repository_root")


@pytest.fixture(autouse=True)
def short_timing(monkeypatch, forked_runs):
    """A tenth of the timed seconds of a kind: what the tests compare does not need more, the CPU (no
    GPU visible, on any machine), and the `fit` process that times a run's start-up forked (see
    CONTRIBUTING: a fresh interpreter is most of what a test costs)."""
    monkeypatch.setattr(step_costs, "TIMED_SECONDS", 0.2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def size(text: str) -> float:
    number, unit = text.split()
    return float(number) * UNITS[unit]


def table(out: str) -> dict[str, dict[str, str]]:
    """The budget's rows by method: column name -> cell."""
    lines = out.splitlines()
    start = next(number for number, line in enumerate(lines) if line.startswith("method "))
    header = re.split(r"\s{2,}", lines[start])
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("total: "):
            break
        cells = re.split(r"\s{2,}", line)
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def write_plan(path: Path, methods: dict, model=None, federation=None, seeds=(0, 1)) -> Path:
    """The smoke plan with other methods, on one split; `model` its model.options, `federation` more
    federation settings."""
    plan = yaml.safe_load(SMOKE.read_text())
    plan.pop("tune")  # its tuned method may not be among `methods`
    plan.update(name="costs", methods=methods, settings={"alpha": {"0.5": [{"data.alpha": 0.5}]}}, seeds=list(seeds))
    if model is not None:
        plan["configs"][1] = {"model.options": model}
    plan["configs"][2].update(federation or {})
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def test_the_smoke_plan_is_timed_once_per_kind_of_step(tmp_path):
    # FedAvg + CONST trains another network (no biases) with a projection; the split (alpha), the seed
    # and the tuned lr (the tuning runs, 0 to 11) change the steps of a round, not what one costs.
    resolved = TunedGrid(load_plan(SMOKE)).resolved
    kinds = [[entry.point.index for entry in kind] for kind in group_by_kind(resolved).values()]
    assert kinds == [[0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20], [3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23]]
    # A hyper-parameter's value adds no pass (FedProx's mu); a switch or a width does (MOON's
    # projection_dim, CONST without its orthogonality).
    plan = write_plan(tmp_path / "plan.yaml", {
        "FedProx": ["configs/algorithms/fedprox.yaml"],
        "FedProx mu=0.5": ["configs/algorithms/fedprox.yaml", {"algorithm.init_args.mu": 0.5}],
        "MOON": ["configs/algorithms/moon.yaml"],
        "MOON narrow": ["configs/algorithms/moon.yaml", {"algorithm.init_args.projection_dim": 32}],
        "CONST": ["configs/algorithms/fedavg.yaml", "configs/const.yaml"],
        "Center": ["configs/algorithms/fedavg.yaml", "configs/const.yaml", {"constraint.init_args.orthogonal": False}],
    })
    kinds = [sorted({entry.point.method for entry in kind})
             for kind in group_by_kind(resolve_grid(load_plan(plan).grid())).values()]
    assert kinds == [["FedProx", "FedProx mu=0.5"], ["MOON"], ["MOON narrow"], ["CONST"], ["Center"]]


@pytest.mark.slow
def test_fedsam_and_moon_are_priced_above_fedavg(tmp_path, capsys):
    # FedSAM takes two forward and backward passes a step, MOON three forward passes; a wider network
    # than the smoke plan's, for its passes to cost more than the steps' bookkeeping.
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": ["configs/algorithms/fedavg.yaml"],
                                               "FedSAM": ["configs/algorithms/fedsam.yaml"],
                                               "MOON": ["configs/algorithms/moon.yaml"]},
                      model={"hidden": 256, "depth": 2})
    status, out, err = run_sweep(capsys, str(plan), "--estimate", "--runs_root", str(tmp_path / "runs"), *ONE_THREAD)
    assert status == 0, err
    assert "3 kind(s) of local step to time here on the CPU, 1 CPU(s) each" in out
    rows = table(out)
    assert list(rows) == ["FedAvg", "FedSAM", "MOON"]  # one line per method
    # The CPU seconds of their steps, on one thread in one process: the work, whatever the load.
    fedavg = float(rows["FedAvg"]["CPU s/round"])
    assert float(rows["FedSAM"]["CPU s/round"]) > 1.3 * fedavg
    assert float(rows["MOON"]["CPU s/round"]) > 1.3 * fedavg
    for row in rows.values():  # two seeds of 3 rounds each
        assert float(row["CPU core-h"]) == pytest.approx(2 * 3 * float(row["CPU s/round"]) / 3600, rel=0.02)
    total = next(line for line in out.splitlines() if line.startswith("total: "))
    core_hours = sum(float(row["CPU core-h"]) for row in rows.values())
    assert total.startswith("total: 6 runs, ") and re.search(r", ([\d.e+-]+) CPU core-hours, ", total)
    assert float(re.search(r", ([\d.e+-]+) CPU core-hours, ", total).group(1)) == pytest.approx(core_hours, rel=0.02)
    assert re.search(r"^timed in \d+ s; the timed steps waited for a CPU \d+% .*: (busy|not busy)", out, re.M)
    # From the methods' declared costs: 3 rounds of 5 clients x 2 steps, FedSAM's and MOON's steps two
    # backward passes each; every method sends its model and BatchNorm statistics each way.
    assert [float(rows[method]["grad evals/run"]) for method in rows] == [30, 60, 60]
    network = create_model("mlp", num_classes=10, in_channels=1, image_size=8, norm="bn", bias=True, hidden=256,
                           depth=2)
    floats = sum(p.numel() for p in network.parameters()) + sum(
        b.numel() for b in network.buffers() if b.is_floating_point())
    assert size(rows["FedAvg"]["bytes/run"]) == pytest.approx(3 * 5 * 2 * 4 * floats, rel=0.01)
    assert rows["FedSAM"]["bytes/run"] == rows["FedAvg"]["bytes/run"]


@pytest.mark.slow
def test_a_points_work_and_checkpoints_are_those_of_a_real_run_of_it(tmp_path, capsys, monkeypatch, forked_runs):
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": ["configs/algorithms/fedavg.yaml"]},
                      federation={"federation.local_steps": None, "federation.local_epochs": 2}, seeds=[0])
    runs = tmp_path / "runs"
    status, _, err = run_sweep(capsys, str(plan), "--index", "0", "--runs_root", str(runs), *ONE_THREAD)
    assert status == 0, err
    files_of_the_run = sorted(runs.rglob("*"))
    status, out, err = run_sweep(capsys, str(plan), "--estimate", "--runs_root", str(runs), *ONE_THREAD)
    assert status == 0, err
    assert sorted(runs.rglob("*")) == files_of_the_run  # timed in a temporary folder
    row = table(out)["FedAvg"]
    # A round's work: the local steps its clients take (2 epochs of their own batches), as the run's
    # clients draw them, over the plan's 3 rounds.
    (entry,) = resolve_grid(load_plan(plan, runs_root=runs).grid())
    point, config = entry.point, entry.config
    partition = json.loads((point.out_dir / "partition.json").read_text())
    federation = config["federation"]
    steps = [len(batch_positions(len(partition[str(client)]), federation["batch_size"], None, 2,
                                 seeded_generator(0, CLIENT_STREAM, round_index, client)))
             for round_index in range(3)
             for client in sample_clients(0, round_index, federation["num_clients"], federation["clients_per_round"])]
    timed = re.search(r"^timed \[0\] .*: (\d+) client step\(s\) in ([\d.e+-]+) s;", out, re.M)
    wall_per_step = float(timed.group(2)) / int(timed.group(1))
    assert float(row["s/round"]) == pytest.approx(wall_per_step * sum(steps) / 3, rel=0.02)
    # The checkpoints a finished run keeps, and their size.
    kept = numbered_checkpoints(checkpoint_dir(point.out_dir))
    assert row["rounds"] == "3" and int(row["kept"]) == len(kept) == 1  # every 3 rounds of 3
    assert size(row["checkpoint"]) == pytest.approx(kept[0].stat().st_size, rel=0.05)
    assert size(row["disk per run"]) == pytest.approx(size(row["checkpoint"]), rel=0.01)
    assert size(row["peak memory"]) > 50 * 2 ** 20  # a process with torch loaded
    assert row["client state"] == "0 B"
    # The run's wall seconds: its start-up (a `fit` process timed for one round), its 3 rounds, the 3
    # rounds it evaluates (eval_every 1) and its one checkpoint.
    start_up = float(re.search(r"^timed the start-up of a run of digits in data \(\[0\], .*\): ([\d.e+-]+) s$", out,
                               re.M).group(1))
    besides = re.search(r"^of the runs' wall time, besides their rounds: start-up ([\d.e+-]+) s x 1 runs, .*; "
                        r"evaluation ([\d.e+-]+) s x 3 evaluations, .*; checkpoint ([\d.e+-]+) s x 1 checkpoints, ",
                        out, re.M)
    assert float(besides.group(1)) == start_up > 0
    assert float(row["s/run"]) == pytest.approx(start_up + 3 * float(row["s/round"]) + 3 * float(besides.group(2))
                                                + float(besides.group(3)), rel=0.02)


@pytest.mark.slow
def test_a_stateful_methods_client_state_is_priced_at_every_client(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", {"SCAFFOLD": ["configs/algorithms/scaffold.yaml"]})
    status, out, err = run_sweep(capsys, str(plan), "--estimate", "--runs_root", str(tmp_path / "runs"), *ONE_THREAD)
    assert status == 0, err
    row = table(out)["SCAFFOLD"]
    # Its control variate c_i, a float32 vector of the network's size, for each of the 10 clients (5
    # a round over 3 rounds reach them all), though only the timed clients held one here.
    network = create_model("mlp", num_classes=10, in_channels=1, image_size=8, norm="bn", bias=True, hidden=16, depth=1)
    state = 10 * 4 * sum(parameter.numel() for parameter in network.parameters())
    assert size(row["client state"]) == pytest.approx(state, rel=0.01)
    assert size(row["checkpoint"]) > state  # the checkpoint's client-state files hold it too
    assert size(row["disk per run"]) == pytest.approx(int(row["kept"]) * size(row["checkpoint"]), rel=0.01)
    store = re.search(r"; client state: up to ([\d.]+ \w+) per run on disk \(client_states/, one file a client\), at "
                      r"most 4.0 GiB of it in memory \(compute.client_state_memory_mib x 1 rank\(s\)\)$", out, re.M)
    assert store is not None, out
    assert state < size(store.group(1)) < size(row["checkpoint"])


def cost(**fields) -> StepCost:
    timed = Stretch(units=100, cpu_seconds=2.0, wall_seconds=1.0)
    return StepCost(**{"grouped": True, "stateful": False, "work": timed, "timed": timed, "peak_bytes": 2 ** 30,
                       "checkpoint_bytes": 2 ** 20, "state_bytes_per_client": 0.0, "shard_bytes_per_client": 0.0,
                       "train_labels": None, **fields})


def test_on_gpus_a_run_is_priced_in_gpu_hours_of_all_its_gpus(capsys):
    (entry,) = resolve_grid(load_plan(SMOKE).grid())[:1]
    gpus = Resources(accelerator="gpu", devices=4, threads=2, gpu_slots=[["0", "1", "2", "3"]])
    # One rank's share of a round: 360 group steps of 0.01 s; 3 rounds on 4 GPUs.
    point = PricedPoint(entry=entry, cost=cost(), units_per_round=360, ranks=4, holding=0, kept=1)
    estimate_module._print_budget([point], gpus, jobs=1)
    out = capsys.readouterr().out
    row = table(out)["FedAvg"]
    assert float(row["s/round"]) == pytest.approx(3.6)
    assert float(row["GPU h"]) == pytest.approx(3.6 * 3 * 4 / 3600, rel=0.01)
    assert float(row["CPU s/round"]) == pytest.approx(0.02 * 360 * 4)  # the host's work, on every rank
    assert row["peak GPU memory"] == "1.0 GiB"
    assert out.splitlines()[-2] == (f"total: 1 runs, {0.02 * 360 * 4 * 3 / 3600:.3g} CPU core-hours, "
                                    f"{3.6 * 3 * 4 / 3600:.3g} GPU hours, {3.6 * 3 / 3600:.3g} h of wall time (1 at a "
                                    "time), 1.0 MiB of checkpoints, peak GPU memory 1.0 GiB per run, and up to 0 B of "
                                    "client state in host memory")


def test_a_runs_wall_time_adds_its_start_up_evaluations_and_checkpoints_to_its_rounds(capsys, monkeypatch):
    # The smoke plan's runs: 3 rounds, each evaluated (eval_every 1), one checkpoint (every 3); 100 client
    # steps a round of 0.01 s; a start-up of 7 s, an evaluation of 0.5 s and a checkpoint of 0.25 s timed.
    resolved = resolve_grid(load_plan(SMOKE).grid())
    monkeypatch.setattr(estimate_module, "units_per_round", lambda *args: (100.0, 100.0))
    kinds = {step_costs.kind_of(entry.config): cost(grouped=False, eval_seconds=0.5, checkpoint_seconds=0.25)
             for entry in resolved}
    cpus = Resources(accelerator="cpu", devices=1, threads=1, gpu_slots=None)
    priced = estimate_module._price(resolved, kinds, {"digits in data": 7.0}, cpus)
    assert {(p.start_up, p.evaluations, p.checkpoints) for p in priced} == {(7.0, 3, 1)}
    run = 7.0 + 3 * 100 * 0.01 + 3 * 0.5 + 1 * 0.25
    assert [p.run_seconds for p in priced] == pytest.approx([run] * 12)
    estimate_module._print_budget(priced, cpus, jobs=2)
    lines = capsys.readouterr().out.splitlines()
    assert float(table("\n".join(lines))["FedAvg"]["s/run"]) == pytest.approx(run, rel=0.01)
    assert f", {12 * run / 2 / 3600:.3g} h of wall time (2 at a time), " in lines[-2]
    assert lines[-1] == (f"of the runs' wall time, besides their rounds: start-up 7 s x 12 runs, {12 * 7 / 3600:.3g} "
                         f"h; evaluation 0.5 s x 36 evaluations, {36 * 0.5 / 3600:.3g} h; checkpoint 0.25 s x 12 "
                         f"checkpoints, {12 * 0.25 / 3600:.3g} h")


def test_a_runs_start_up_is_a_fit_process_of_one_round_less_that_round_its_evaluation_and_checkpoint(
        tmp_path, monkeypatch):
    (entry,) = resolve_grid(load_plan(SMOKE).grid())[:1]
    started = []

    class FinishedRun:
        """A fit process that has trained its round: 1.5 s, evaluated in 0.5 s."""

        def wait(self):
            MetricsLog(tmp_path / "start", [{"round": 1, "round_seconds": 1.5, "eval_seconds": 0.5}])
            clock.append(10.0)  # its exit, 10 s after its start
            return 0

        def poll(self):
            return 0

    def start(command, environment, log, cpus):
        started.append((command, environment, cpus))
        return FinishedRun()

    clock = [0.0]
    monkeypatch.setattr(step_costs.local, "start_run_process", start)
    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: clock[-1])
    monkeypatch.setenv("WANDB_MODE", "online")
    cpus = Resources(accelerator="cpu", devices=1, threads=2, gpu_slots=None, cpu_slots=[[0, 1]])
    seconds = step_costs.time_start_up(entry, cpus, tmp_path / "start", cost(checkpoint_seconds=0.25))
    assert seconds == 10.0 - 1.5 - 0.5 - 0.25
    ((command, environment, bound),) = started
    arguments = " ".join(command)
    # The point's own run, as a sweep starts it, for one round of one step, in the folder given, W&B off.
    assert arguments.startswith(" ".join([sys.executable, "-m", "fl_lightning", "fit"]))
    for option in ("--federation.rounds 1", "--federation.local_steps 1", "--federation.local_epochs null",
                   "--logger.wandb_mode disabled", f"--out_dir {tmp_path / 'start'}", "--seed 0"):
        assert f" {option} " in f"{arguments} ", option
    assert environment["WANDB_MODE"] == "disabled" and bound == [0, 1]


@pytest.mark.parametrize("every, rounds, evaluated", [(1, 3, 3), (4, 12, 3), (5, 12, 3), (20, 3, 1)])
def test_a_run_evaluates_every_eval_every_rounds_and_after_the_last(every, rounds, evaluated):
    # As the Evaluate callback does, counted directly.
    assert estimate_module.evaluated_rounds(every, rounds) == evaluated == \
        sum(1 for r in range(1, rounds + 1) if r % every == 0 or r == rounds)


def test_the_estimate_says_nothing_of_lightnings_srun_hint(tmp_path, monkeypatch):
    """Lightning warns wherever an srun binary exists; about `fit` under SLURM, not the estimate."""
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_costs._fabric(Resources(accelerator="cpu", devices=1, threads=1, gpu_slots=None), "32-true")
    assert [str(w.message) for w in caught if "srun" in str(w.message)] == []


@pytest.mark.parametrize("setting", ["auto", 4])
def test_a_kind_is_timed_on_the_threads_fit_gives_a_sweep_run(monkeypatch, setting):
    # On GPUs a run's host threads are the OMP_NUM_THREADS the sweep gives it, whatever compute.cpu_threads
    # says (fit reads it on the CPU only); on CPUs of its own the run chooses from them.
    gpus = Resources(accelerator="gpu", devices=1, threads=3, gpu_slots=[["0"]])
    assert step_costs.sweep_run_threads(setting, 11_000_000, gpus) == 3
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu, "cgroup_cpu_quota", lambda: None)
    own_cpus = Resources(accelerator="cpu", devices=1, threads=2, gpu_slots=None, cpu_slots=[[0, 1]])
    assert step_costs.sweep_run_threads(setting, 11_000_000, own_cpus) == (2 if setting == "auto" else 4)
    assert step_costs.sweep_run_threads(setting, 62_000, own_cpus) == (1 if setting == "auto" else 4)


@pytest.mark.parametrize("waiting, loads, verdict", [
    (0.0, (0.3, 1.0), "not busy"),
    (1.0, (0.3, 1.0), "busy"),  # its threads waited a third of the time for a CPU
    (0.0, (5.0, 4.0), "busy"),  # more work than cores
])
def test_a_busy_machine_is_said_to_be(waiting, loads, verdict):
    stretches = [Stretch(units=10, cpu_seconds=2.0, wall_seconds=2.0, waiting_seconds=waiting)]
    note = machine_note(stretches, *loads, cores=2)
    assert note.endswith(": not busy" if verdict == "not busy" else ": busy: other work inflated the wall seconds (the "
                         "CPU seconds on one thread far less); time it again on a quiet machine for a round's wall "
                         "seconds"), note


@pytest.fixture
def ctrl_c_interrupts():
    """SIGINT raises KeyboardInterrupt in this process, as in a terminal's foreground, whatever pytest
    inherited: a process started where SIGINT is ignored (a background job of a non-interactive shell,
    `make test &` in a script) keeps it ignored, and Python then installs no handler of its own; one
    started with SIGINT blocked keeps it blocked. The previous action and mask are put back afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_ctrl_c_ends_the_estimate_with_the_points_priced_so_far(capsys, monkeypatch, ctrl_c_interrupts):
    timed = []

    def interrupted_at_the_second(entry, machine, out_dir):
        timed.append(entry.point.index)
        if len(timed) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the second kind starts: raised here, at once
        return time_kind(entry, machine, out_dir)

    time_kind = step_costs.time_kind
    monkeypatch.setattr(estimate_module, "time_kind", interrupted_at_the_second)
    status, out, err = run_sweep(capsys, str(SMOKE), "--estimate", *ONE_THREAD)
    assert status == 130 and timed == [0, 3]
    assert err.splitlines() == ["interrupted: 1 of 2 kind(s) timed; not priced: FedAvg + CONST"]
    # FedAvg's tuning runs are priced on a line of their own.
    assert list(table(out)) == ["FedAvg (tuning)", "FedAvg"] and "total: 12 runs, " in out
    assert re.search(r"^timed in \d+ s; ", out, re.M)


def test_ctrl_c_before_any_kind_is_timed_prices_nothing_and_says_so(capsys, monkeypatch):
    def interrupted(entry, machine, out_dir):
        raise KeyboardInterrupt  # what Ctrl-C raises here

    monkeypatch.setattr(estimate_module, "time_kind", interrupted)
    status, out, err = run_sweep(capsys, str(SMOKE), "--mode", "estimate", *ONE_THREAD)
    assert status == 130
    assert err.splitlines() == ["interrupted: 0 of 2 kind(s) timed; not priced: FedAvg, FedAvg + CONST"]
    assert "total:" not in out and "timed in" not in out
