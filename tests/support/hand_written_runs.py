"""Run folders written by hand as fit leaves them (config.yaml and metrics rows, no training), and a plan whose
grid they fill: what the tests of table and compare read. The fixtures `point_configs` and `sweep` are the
tests' own (tests/conftest.py's pytest_plugins)."""

import statistics
from pathlib import Path

import pytest
import yaml
from paths import REPOSITORY

from fl_lightning.checkpoint import FINAL_STOP, save_checkpoint
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.plans.resolve import resolve_grid
from fl_lightning.run_logging import MetricsLog

PNG = b"\x89PNG\r\n\x1a\n"
ROUNDS = 4  # evaluations at rounds 2 and 4


def write_run(out_dir: Path, accuracies: list[float], losses: list[float] = None, config: dict = None) -> None:
    """A run folder as `fit` leaves it: config.yaml (`config`, by default a FedAvg run of ROUNDS rounds)
    and one metrics row per round done, evaluated every second round; `accuracies` (and `losses`) are
    the values of its evaluations."""
    out_dir.mkdir(parents=True)
    config = config or {"algorithm": {"class_path": "fl_lightning.algorithms.fedavg.FedAvg", "init_args": {}},
                        "federation": {"rounds": ROUNDS}, "seed": 0}
    (out_dir / "config.yaml").write_text(yaml.safe_dump(config))
    log = MetricsLog(out_dir, history=[])
    evaluations = iter(zip(accuracies, losses or [1.0] * len(accuracies)))
    for round_index in range(1, 2 * len(accuracies) + 1):
        row = {"round": round_index, "train_loss": 2.0 / round_index, "round_seconds": 0.1}
        if round_index % 2 == 0:
            accuracy, loss = next(evaluations)
            row.update(test_accuracy=accuracy, test_loss=loss)
        log.append(row)



def write_checkpoint(folder: Path, round_index: int, config: dict, final_stop=None, metrics=()) -> None:
    """A checkpoint of round `round_index` as fit writes it, of a run of settings `config`, with a final
    stop when given (an early stop's reason); no model, which nothing that reads a run folder loads."""
    save_checkpoint({"round": round_index, "model": {}, "algorithm": {}, "partition": [], "metrics": list(metrics),
                     "hyperparameters": config, FINAL_STOP: final_stop}, folder, keep=10)


# The plan: FedAvg + CONST is listed last, but belongs right after FedAvg.
METHODS = {"FedAvg": [{"algorithm": "fedavg"}], "SCAFFOLD": [{"algorithm": "scaffold"}],
           "FedAvg + CONST": [{"algorithm": "fedavg"}, str(REPOSITORY / "configs" / "const.yaml")]}


# evaluation stopped at round 2 of 4; a missing seed was never started.
RUNS = {
    ("alpha-0.5", "FedAvg"): {0: ([0.60, 0.70], [1.2, 0.9]), 1: ([0.75, 0.72], [1.0, 0.8]),
                              2: ([0.65, 0.74], [1.1, 1.0])},
    ("alpha-0.5", "SCAFFOLD"): {0: ([0.50, 0.80], [1.5, 0.5]), 1: ([0.50, 0.78], [1.5, 0.6]),
                                2: ([0.50, 0.76], [1.5, 0.7])},
    ("alpha-0.5", "FedAvg + CONST"): {0: ([0.70, 0.75], [0.8, 0.7]), 1: ([0.70, 0.77], [0.8, 0.9]),
                                      2: ([0.70, 0.79], [0.8, 0.8])},
    ("alpha-0.1", "FedAvg"): {0: ([0.40, 0.50], [2.0, 1.5]), 1: ([0.40, 0.54], [2.0, 1.4])},  # seed 2 missing
    ("alpha-0.1", "SCAFFOLD"): {0: ([0.30, 0.40], [2.5, 2.0]), 1: ([0.30, 0.44], [2.5, 2.2]),
                                2: ([0.30, 0.42], [2.5, 2.1])},
    ("alpha-0.1", "FedAvg + CONST"): {0: ([0.45, 0.60], [1.8, 1.2]), 1: ([0.90], [0.3]),  # seed 1 unfinished
                                      2: ([0.45, 0.62], [1.8, 1.1])},
}


def write_demo_plan(folder: Path) -> Path:
    plan_file = folder / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({
        "name": "demo", "configs": [str(REPOSITORY / "configs" / "quickstart.yaml"), {"federation.rounds": ROUNDS}],
        "methods": METHODS, "seeds": [0, 1, 2], "reference": "paper.csv",
        "settings": {"alpha": {"0.5": [{"data.alpha": 0.5}], "0.1": [{"data.alpha": 0.1}]}}}, sort_keys=False))
    return plan_file


@pytest.fixture(scope="module")
def point_configs(tmp_path_factory) -> dict[tuple[str, str, int], dict]:
    """(setting, method, seed) -> the config `fit` records for that point of the demo plan (resolved once:
    parsing every point takes a while)."""
    plan = load_plan(write_demo_plan(tmp_path_factory.mktemp("plan")))
    return {(e.point.setting_name, e.point.method, e.point.seed): e.config for e in resolve_grid(plan.grid())}


def write_sweep(folder: Path, point_configs: dict) -> Path:
    """A plan of 3 methods x 2 settings x 3 seeds, its runs under folder/runs, and a reference CSV, named
    from the working folder, `folder`."""
    (folder / "paper.csv").write_text("method,alpha-0.5,alpha-0.1\n"
                                      "FedAvg,71.50,\n"
                                      "fedavg+const,76.00 ± 0.40,60.00\n"
                                      "FedProx,70.00,50.00\n")
    plan_file = write_demo_plan(folder)
    for point in load_plan(plan_file, runs_root=folder / "runs").grid():
        seeds = RUNS[point.setting_name, point.method]
        if point.seed in seeds:
            accuracies, losses = seeds[point.seed]
            config = {**point_configs[point.setting_name, point.method, point.seed], "out_dir": str(point.out_dir)}
            write_run(point.out_dir, accuracies, losses, config)
    return plan_file


@pytest.fixture
def sweep(tmp_path, monkeypatch, point_configs):
    """The demo plan's sweep (write_sweep) in tmp_path, for a test to change."""
    monkeypatch.chdir(tmp_path)
    return write_sweep(tmp_path, point_configs)


def write_plan_runs(plan_file: Path, runs_root: Path, accuracies: list[float]) -> None:
    """A run of every grid point of the plan, made with the point's settings, each evaluated `accuracies` plus
    its seed / 100 (the plan's rounds must be 2 * len(accuracies))."""
    for resolved in resolve_grid(load_plan(plan_file, runs_root=runs_root).grid()):
        point = resolved.point
        write_run(point.out_dir, [accuracy + point.seed / 100 for accuracy in accuracies],
                  config={**resolved.config, "out_dir": str(point.out_dir)})


def run_folder(plan_file: Path, setting: str, method: str, seed: int) -> Path:
    return plan_file.parent / "runs" / "demo" / setting / method / f"seed{seed}"


def rows_by_method(rows: list[dict]) -> dict[str, dict]:
    """table.csv's rows by their method."""
    return {row["method"]: row for row in rows}


T_975 = {2: 4.302653, 3: 3.182446}
"""Student's t, 0.975 quantile, by degrees of freedom (as statistics tables print it)."""


def direct_interval(differences: list[float]) -> tuple[float, float]:
    mean, n = statistics.fmean(differences), len(differences)
    half = T_975[n - 1] * statistics.stdev(differences) / n ** 0.5
    return mean - half, mean + half


def write_compare_runs(tmp_path: Path) -> None:
    for name, accuracies in {"fedavg": [0.2, 0.5, 0.4], "ctpfl": [0.1, 0.3, 0.35]}.items():
        run = tmp_path / name
        run.mkdir()
        log = MetricsLog(run, history=[])
        for round_index, accuracy in enumerate(accuracies, start=1):
            log.append({"round": round_index, "train_loss": 1.0 - accuracy, "test_accuracy": accuracy})
        class_path = {"fedavg": "fl_lightning.algorithms.FedAvg", "ctpfl": "fl_lightning.algorithms.ctpfl.CTPFL"}[name]
        (run / "config.yaml").write_text(f"algorithm:\n  class_path: {class_path}\n")


def write_seeded_runs(root: Path, method: str, finals: dict[int, list[float]], rounds: int = ROUNDS) -> None:
    """root/<method>/seed<k>: runs of one experiment (FedAvg, or FedProx with mu `method`), seed k's evaluations
    `finals[k]`."""
    algorithm = ({"class_path": "fl_lightning.algorithms.fedavg.FedAvg", "init_args": {}} if method == "fedavg" else
                 {"class_path": "fl_lightning.algorithms.fedprox.FedProx", "init_args": {"mu": float(method[2:])}})
    for seed, accuracies in finals.items():
        write_run(root / method / f"seed{seed}", accuracies,
                  config={"algorithm": algorithm, "federation": {"rounds": rounds}, "seed": seed})
