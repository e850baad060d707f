"""`fl-lightning sweep PLAN --estimate`: one point timed per distinct (model, data, federation) of the
smoke plan's grid, and, on a plan of two methods of one such shape, the estimate's figures against a
real run of its point (seconds per round, the checkpoints a run keeps and their size), nothing left
in the runs folder."""

import re
from pathlib import Path

import pytest
import yaml

from fl_lightning.checkpoint import checkpoint_dir, numbered_checkpoints
from fl_lightning.cli.main import main as fl_lightning_main
from fl_lightning.experiments.estimate import group_by_shape
from fl_lightning.experiments.plan import load_plan
from fl_lightning.experiments.resolve import resolve_grid
from fl_lightning.run_logging import read_metrics

REPOSITORY = Path(__file__).resolve().parents[1]
SMOKE = REPOSITORY / "configs" / "plans" / "smoke.yaml"
# Rounds of some tenths of a second, long enough to time on a machine that other work shares.
LONGER_ROUNDS = ["--override", "federation.local_steps=40"]
UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}
pytestmark = pytest.mark.usefixtures("in_repository_root")


def size(text: str) -> float:
    number, unit = text.split()
    return float(number) * UNITS[unit]


def sweep(capsys, plan: Path, *arguments: str) -> str:
    capsys.readouterr()
    fl_lightning_main(["sweep", str(plan), *arguments])
    return capsys.readouterr().out


def test_the_smoke_plan_is_timed_at_one_point_per_model_and_split():
    # FedAvg and FedAvg + CONST train other models (CONST: no biases) on two splits: four points, two
    # runs (seeds) each.
    resolved = resolve_grid(load_plan(SMOKE).grid())
    groups = [[(entry.point.index, entry.point.method, entry.point.setting_name) for entry in group]
              for group in group_by_shape(resolved).values()]
    assert groups == [[(index, method, alpha), (index + 1, method, alpha)] for index, method, alpha in [
        (0, "FedAvg", "alpha-0.5"), (2, "FedAvg + CONST", "alpha-0.5"), (4, "FedAvg", "alpha-0.1"),
        (6, "FedAvg + CONST", "alpha-0.1")]]


def write_one_shape_plan(path: Path) -> Path:
    """The smoke plan with FedAvg and FedProx (one model) on one split: 4 runs, one point to time."""
    plan = yaml.safe_load(SMOKE.read_text())
    plan.update(name="one-shape", methods={"FedAvg": ["configs/algorithms/fedavg.yaml"],
                                           "FedProx": ["configs/algorithms/fedprox.yaml"]},
                settings={"alpha": {"0.5": [{"data.alpha": 0.5}]}})
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


@pytest.mark.slow
def test_the_estimate_of_a_point_matches_a_real_run_of_it(tmp_path, capsys, monkeypatch, forked_runs):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    plan = write_one_shape_plan(tmp_path / "plan.yaml")
    runs = tmp_path / "runs"
    # One thread a run: timings that other work on the machine disturbs least (no threads waiting on
    # each other for a core).
    options = ["--runs_root", str(runs), "--threads_per_run", "1", *LONGER_ROUNDS]
    # The first point for real, as the sweep runs it (forked here), then at once the estimate, which
    # times it in a fresh interpreter of its own (its peak memory is that process's).
    sweep(capsys, plan, "--index", "0", *options)
    point = load_plan(plan, runs_root=runs, overrides=LONGER_ROUNDS[1:]).grid()[0]
    measured = [row["round_seconds"] for row in read_metrics(point.out_dir)][1:]
    kept_by_the_run = numbered_checkpoints(checkpoint_dir(point.out_dir))
    files_of_the_runs = sorted(runs.rglob("*"))

    out = sweep(capsys, plan, "--estimate", *options)
    lines = out.splitlines()
    assert lines[1].startswith("estimate of plan one-shape@local_steps40-") and "(4 runs): 1 point(s)" in lines[1]
    header = lines.index(next(line for line in lines if line.startswith("point ")))
    (row,) = [re.split(r"\s{2,}", line) for line in lines[header + 1:header + 2]]
    # FedAvg and FedProx train one model on one split: one point for their four runs.
    assert row[:2] == ["[0] FedAvg | alpha-0.5 | seed 0", "4"] and row[3] == "3"
    assert lines[header + 2].startswith("total: 4 runs, ")
    assert sorted(runs.rglob("*")) == files_of_the_runs  # timed in a temporary folder

    seconds, kept, checkpoint = float(row[2]), int(row[7]), size(row[6])
    assert size(row[5]) > 50 * 2 ** 20  # a process with torch loaded
    assert size(row[9]) == pytest.approx(kept * checkpoint, rel=0.01)
    # CPU-core hours: runs x rounds x seconds x the run's one thread
    assert float(row[4]) == pytest.approx(4 * 3 * seconds / 3600, rel=0.02)
    # The real run's rounds after the first's warm-up, timed by the run itself, are within 2x of the
    # estimate (the run's slowest and fastest, on a machine that other work shares).
    assert min(measured) / 2 <= seconds <= 2 * max(measured), (seconds, measured)
    assert len(kept_by_the_run) == kept == 1  # every 3 rounds of 3
    assert kept_by_the_run[0].stat().st_size == pytest.approx(checkpoint, rel=0.2)
