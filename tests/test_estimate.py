"""`fl-lightning sweep PLAN --estimate` on the smoke plan: one point timed per distinct (model, data,
federation), nothing left in the runs folder, and its figures against a real run of the same point
(seconds per round, the checkpoints a run keeps and their size)."""

import re
from pathlib import Path

import pytest

from fl_lightning.checkpoint import checkpoint_dir, numbered_checkpoints
from fl_lightning.cli.main import main as fl_lightning_main
from fl_lightning.experiments.plan import load_plan
from fl_lightning.run_logging import read_metrics

REPOSITORY = Path(__file__).resolve().parents[1]
SMOKE = "configs/plans/smoke.yaml"
# Rounds of some tenths of a second, long enough to time on a machine that other work shares.
LONGER_ROUNDS = ["--override", "federation.local_steps=40"]
UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}


def size(text: str) -> float:
    number, unit = text.split()
    return float(number) * UNITS[unit]


def sweep(capsys, *arguments: str) -> str:
    capsys.readouterr()
    fl_lightning_main(["sweep", SMOKE, *arguments])
    return capsys.readouterr().out


@pytest.mark.slow
def test_the_estimate_of_the_smoke_plan_matches_a_real_run_of_its_point(tmp_path, capsys, monkeypatch,
                                                                       forked_runs):
    monkeypatch.chdir(REPOSITORY)  # the plan names its fragments from the repository root
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    runs = tmp_path / "runs"
    # One thread a run: timings that other work on the machine disturbs least (no threads waiting on
    # each other for a core).
    options = ["--runs_root", str(runs), "--threads_per_run", "1", *LONGER_ROUNDS]
    # The first point for real, as the sweep runs it (forked here), then at once the estimate, which
    # times it first, each point in a fresh interpreter of its own (its peak memory is that process's).
    sweep(capsys, "--index", "0", *options)
    point = load_plan(REPOSITORY / SMOKE, runs_root=runs, overrides=LONGER_ROUNDS[1:]).grid()[0]
    measured = [row["round_seconds"] for row in read_metrics(point.out_dir)][1:]
    kept_by_the_run = numbered_checkpoints(checkpoint_dir(point.out_dir))
    files_of_the_runs = sorted(runs.rglob("*"))

    out = sweep(capsys, "--estimate", *options)
    lines = out.splitlines()
    assert lines[1].startswith("estimate of plan smoke@local_steps40-") and "(8 runs): 4 point(s)" in lines[1]
    header = lines.index(next(line for line in lines if line.startswith("point ")))
    rows = [re.split(r"\s{2,}", line) for line in lines[header + 1:header + 5]]
    # FedAvg and FedAvg + CONST train other models (CONST: no biases) on two splits: four points, two runs each.
    assert [row[0] for row in rows] == ["[0] FedAvg | alpha-0.5 | seed 0", "[2] FedAvg + CONST | alpha-0.5 | seed 0",
                                        "[4] FedAvg | alpha-0.1 | seed 0", "[6] FedAvg + CONST | alpha-0.1 | seed 0"]
    assert all(row[1] == "2" and row[3] == "3" for row in rows)
    assert lines[header + 5].startswith("total: 8 runs, ")
    assert sorted(runs.rglob("*")) == files_of_the_runs  # timed in a temporary folder

    seconds, kept, checkpoint = float(rows[0][2]), int(rows[0][7]), size(rows[0][6])
    assert size(rows[0][5]) > 50 * 2 ** 20  # a process with torch loaded
    assert size(rows[0][9]) == pytest.approx(kept * checkpoint, rel=0.01)
    # CPU-core hours: runs x rounds x seconds x the run's one thread
    assert float(rows[0][4]) == pytest.approx(2 * 3 * seconds / 3600, rel=0.02)
    # The real run's rounds after the first's warm-up, timed by the run itself, are within 2x of the
    # estimate (the run's slowest and fastest, on a machine that other work shares).
    assert min(measured) / 2 <= seconds <= 2 * max(measured), (seconds, measured)
    assert len(kept_by_the_run) == kept == 1  # every 3 rounds of 3
    assert kept_by_the_run[0].stat().st_size == pytest.approx(checkpoint, rel=0.2)
