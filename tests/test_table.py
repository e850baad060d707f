"""`fl-lightning table` and `fl-lightning compare` on run folders written by hand (no training)."""

import csv
import io
import json
import re
import shutil
import statistics
from pathlib import Path

import pytest
import yaml

from fl_lightning.checkpoint import FINAL_STOP, save_checkpoint
from fl_lightning.commands.main import main
from fl_lightning.compare import compare
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plan import load_plan
from fl_lightning.experiments.plot import mean_curve
from fl_lightning.experiments.resolve import resolve_grid
from fl_lightning.experiments.runs import RunFolder, value_at
from fl_lightning.experiments.table import table, table_files
from fl_lightning.experiments.table_cells import order_methods
from fl_lightning.experiments.table_sources import setting_label
from fl_lightning.metric_names import Best, best_round
from fl_lightning.run_logging import MetricsLog, read_metrics

pytestmark = pytest.mark.slow  # end to end: the tests train runs in-process or in subprocesses
PNG = b"\x89PNG\r\n\x1a\n"
ROUNDS = 4  # evaluations at rounds 2 and 4
REPOSITORY = Path(__file__).resolve().parents[1]


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


# The plan: FedAvg + CONST is listed last, but belongs right after FedAvg.
METHODS = {"FedAvg": [{"algorithm": "fedavg"}], "SCAFFOLD": [{"algorithm": "scaffold"}],
           "FedAvg + CONST": [{"algorithm": "fedavg"}, str(REPOSITORY / "configs" / "const.yaml")]}
# (setting, method) -> seed -> (accuracies at rounds 2 and 4, test losses); a run with one
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


@pytest.fixture(scope="module")
def plain_table(tmp_path_factory, point_configs):
    """`fl-lightning table` of the unchanged sweep with no options, made once for the tests that only
    read its rows."""
    folder = tmp_path_factory.mktemp("sweep")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        return run_table(write_sweep(folder, point_configs))


def run_folder(plan_file: Path, setting: str, method: str, seed: int) -> Path:
    return plan_file.parent / "runs" / "demo" / setting / method / f"seed{seed}"


def run_table(plan_file: Path, *options: str) -> tuple[str, list[dict], Path]:
    """`fl-lightning table`: (printed text, table.csv rows, output folder); the files of another metric
    or `--at` than the plan's metric at the final round are named with them."""
    out = plan_file.parent / "out"
    main(["table", "--plan", str(plan_file), "--runs_root", str(plan_file.parent / "runs"), "--out", str(out),
          *options])
    metric, at = (options[options.index(option) + 1] if option in options else default
                  for option, default in (("--metric", "test_accuracy"), ("--at", "final")))
    files = table_files(out, metric, at, "test_accuracy")
    return files["md"].read_text(), list(csv.DictReader(io.StringIO(files["csv"].read_text()))), out


def rows_by_method(rows: list[dict]) -> dict[str, dict]:
    return {row["method"]: row for row in rows}


def test_final_round_mean_sample_std_and_seed_counts(sweep, capsys):
    markdown, rows, out = run_table(sweep)
    assert capsys.readouterr().out.startswith(markdown)  # the Markdown is printed
    cells = rows_by_method(rows)
    assert [row["method"] for row in rows] == ["FedAvg", "FedAvg + CONST", "SCAFFOLD"]  # + CONST after its base
    fedavg = cells["FedAvg"]
    assert float(fedavg["alpha-0.5:mean"]) == pytest.approx(72.0)  # 70, 72, 74
    assert float(fedavg["alpha-0.5:std"]) == pytest.approx(2.0)  # sample std, ddof = 1
    assert fedavg["alpha-0.5:n"] == "3"
    assert float(fedavg["alpha-0.1:mean"]) == pytest.approx(52.0) and fedavg["alpha-0.1:n"] == "2"  # seed 2 missing
    assert float(fedavg["alpha-0.1:std"]) == pytest.approx(statistics.stdev([50.0, 54.0]))
    const = cells["FedAvg + CONST"]
    assert float(const["alpha-0.1:mean"]) == pytest.approx(61.0) and const["alpha-0.1:n"] == "2"  # unfinished left out
    assert float(cells["SCAFFOLD"]["alpha-0.5:mean"]) == pytest.approx(78.0)

    lines = markdown.splitlines()
    assert lines[0] == "| method | α = 0.5 | paper | Δ | α = 0.1 | paper | Δ |"
    assert lines[2] == "| FedAvg | 72.00 ± 2.00 (3) | 71.50 | +0.50 | 52.00 ± 2.83 (2) | – | – |"
    assert lines[3] == "| FedAvg + CONST | 77.00 ± 2.00 (3) | 76.00 | +1.00 | **61.00 ± 1.41** (2) | 60.00 | +1.00 |"
    assert lines[4] == "| SCAFFOLD | **78.00 ± 2.00** (3) | – | – | 42.00 ± 2.00 (3) | – | – |"
    notes = markdown.split("\n\n", 1)[1]
    assert "alpha-0.1/FedAvg + CONST/seed1 (round 2/4)" in notes and "not counted, unfinished" in notes
    assert "not started: alpha-0.1/FedAvg/seed2" in notes
    assert (out / "plot.png").read_bytes()[:8] == PNG


def test_best_of_each_column_is_marked_in_markdown_and_csv(plain_table):
    _, rows, _ = plain_table
    best = {(row["method"], setting) for row in rows for setting in ("alpha-0.5", "alpha-0.1")
            if row[f"{setting}:best"] == "1"}
    assert best == {("SCAFFOLD", "alpha-0.5"), ("FedAvg + CONST", "alpha-0.1")}


def test_reference_numbers_and_differences(plain_table):
    _, rows, _ = plain_table
    cells = rows_by_method(rows)
    assert float(cells["FedAvg"]["alpha-0.5:paper"]) == 71.5
    assert float(cells["FedAvg"]["alpha-0.5:diff"]) == pytest.approx(0.5)
    assert cells["FedAvg"]["alpha-0.1:paper"] == "" and cells["FedAvg"]["alpha-0.1:diff"] == ""  # not reported
    assert float(cells["FedAvg + CONST"]["alpha-0.5:paper"]) == 76.0  # matched by folder form, "± 0.40" ignored
    assert float(cells["FedAvg + CONST"]["alpha-0.1:diff"]) == pytest.approx(1.0)
    assert cells["SCAFFOLD"]["alpha-0.5:paper"] == ""  # not in the reference; its FedProx row is ignored
    assert "FedProx" not in cells


def test_partial_runs_count_only_when_asked(sweep):
    markdown, rows, _ = run_table(sweep, "--include_partial", "true")
    const = rows_by_method(rows)["FedAvg + CONST"]
    assert const["alpha-0.1:n"] == "3"
    assert float(const["alpha-0.1:mean"]) == pytest.approx((60 + 90 + 62) / 3)  # its last round counts
    assert "counted although unfinished: alpha-0.1/FedAvg + CONST/seed1 (round 2/4)" in markdown


def test_at_best_and_last_k(sweep):
    _, rows, _ = run_table(sweep, "--at", "best")
    fedavg = rows_by_method(rows)["FedAvg"]
    assert float(fedavg["alpha-0.5:mean"]) == pytest.approx((70 + 75 + 74) / 3)  # seed 1 peaked at round 2
    _, rows, _ = run_table(sweep, "--at", "last:2")
    fedavg = rows_by_method(rows)["FedAvg"]
    assert float(fedavg["alpha-0.5:mean"]) == pytest.approx((65 + 73.5 + 69.5) / 3)


def test_losses_take_the_minimum_and_the_lowest_is_best(sweep):
    markdown, rows, _ = run_table(sweep, "--metric", "test_loss", "--at", "best")
    cells = rows_by_method(rows)
    assert float(cells["FedAvg"]["alpha-0.5:mean"]) == pytest.approx((0.9 + 0.8 + 1.0) / 3)  # minima, not maxima
    assert float(cells["SCAFFOLD"]["alpha-0.5:mean"]) == pytest.approx(0.6)
    assert cells["SCAFFOLD"]["alpha-0.5:best"] == "1"  # 0.6 is the lowest of the column
    assert "| SCAFFOLD | **0.6000 ± 0.1000** (3)" in markdown  # losses as they are, 4 decimals
    assert "test_loss, at the best evaluation" in markdown and "the lowest of its column" in markdown


def test_value_rules():
    assert value_at([0.3, 0.5, 0.4], "final") == 0.4
    assert value_at([0.3, 0.5, 0.4], "last:2") == pytest.approx(0.45)
    assert value_at([0.3], "last:5") == 0.3
    assert value_at([], "final") is None
    for bad in ("last", "last:0", "median"):
        with pytest.raises(ConfigError):
            value_at([0.3], bad)
    with pytest.raises(ValueError, match="best_round"):  # a best needs the rounds: metric_names.best_round
        value_at([0.3], "best")
    rows = [{"round": 2 * index, "test_accuracy": accuracy, "test_loss": loss}
            for index, (accuracy, loss) in enumerate([(0.3, 0.9), (0.5, 0.6), (0.4, 0.7), (0.5, 0.6)], start=1)]
    # Without a validation split: the test metric's own best, the earliest round on a tie, chosen on the test set.
    assert best_round(rows, "test_accuracy") == Best("test_accuracy", round=4, value=0.5, selected_on="test_accuracy")
    assert best_round(rows, "test_loss") == Best("test_loss", round=4, value=0.6, selected_on="test_loss")
    assert not best_round(rows, "test_accuracy").on_validation
    assert best_round(rows, "train_loss") is None


def test_const_rows_follow_their_base_method():
    assert order_methods(["A + CONST", "B", "A", "C + CONST"]) == ["B", "A", "A + CONST", "C + CONST"]
    assert order_methods(["fedavg+const", "fedavg", "scaffold"]) == ["fedavg", "fedavg+const", "scaffold"]


def test_column_labels_from_the_axis_values():
    axes = {"dataset": ["cifar10", "cifar100"], "alpha": ["0.5", "0.1"], "clients": ["100"]}
    assert setting_label({"dataset": "cifar100", "alpha": "0.1", "clients": "100"}, axes) == "CIFAR-100, α = 0.1"
    assert setting_label({"clients": "100"}, {"clients": ["100"]}) == "clients = 100"  # the only axis stays


def test_curve_mean_and_bands_over_seeds():
    runs = [[(2, 60.0), (4, 70.0)], [(2, 64.0), (4, 74.0)], [(2, 62.0)]]
    rounds, means, lower, upper = mean_curve(runs, "minmax")
    assert (rounds, means, lower, upper) == ([2, 4], [62.0, 72.0], [60.0, 70.0], [64.0, 74.0])
    _, _, lower, upper = mean_curve(runs, "std")
    assert lower == pytest.approx([60.0, 72 - 2 ** 1.5]) and upper == pytest.approx([64.0, 72 + 2 ** 1.5])


def test_run_folders_or_a_glob_instead_of_a_plan(sweep, capsys):
    runs = sweep.parent / "runs" / "demo"
    out = sweep.parent / "from_glob"
    main(["table", "--plan", str(runs / "alpha-0.5" / "*" / "seed*"), "--out", str(out)])
    rows = rows_by_method(list(csv.DictReader(io.StringIO((out / "table.csv").read_text()))))
    assert list(rows) == ["fedavg", "fedavg+const", "scaffold"]  # the folders' names
    assert float(rows["fedavg"]["alpha-0.5:mean"]) == pytest.approx(72.0)
    assert "| method | α = 0.5 |" in capsys.readouterr().out
    table(plan=str(runs))  # the plan's folder: its runs, the table written beside them
    assert (runs / "table.md").is_file() and (runs / "plot.png").read_bytes()[:8] == PNG


def test_bad_at_is_refused_naming_the_option(sweep, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_table(sweep, "--at", "last:x")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: at: expected final, best or last:K")


def test_runs_made_with_other_settings_than_their_point_are_left_out_and_named(sweep):
    # One run's folder holds another alpha; then FedAvg's learning rate is fixed in the plan after its runs.
    config_file = run_folder(sweep, "alpha-0.5", "fedavg", 1) / "config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["data"]["alpha"] = 0.1
    config_file.write_text(yaml.safe_dump(config))
    markdown, rows, _ = run_table(sweep)
    fedavg = rows_by_method(rows)["FedAvg"]
    assert fedavg["alpha-0.5:n"] == "2" and float(fedavg["alpha-0.5:mean"]) == pytest.approx(72.0)  # 70 and 74
    notes = markdown.split("\n\n", 1)[1]
    assert ("not counted, made with other settings than the plan's (rerun them in folders of their own): "
            "alpha-0.5/FedAvg/seed1 (data.alpha 0.1 -> 0.5 (config.yaml))") in notes

    plan = yaml.safe_load(sweep.read_text())
    plan["methods"]["FedAvg"].append({"client_optimizer.lr": 0.5})
    sweep.write_text(yaml.safe_dump(plan, sort_keys=False))
    markdown, rows, _ = run_table(sweep)
    fedavg = rows_by_method(rows)["FedAvg"]
    assert fedavg["alpha-0.5:n"] == fedavg["alpha-0.1:n"] == "0"
    assert "alpha-0.1/FedAvg/seed0 (client_optimizer.lr 0.05 -> 0.5 (config.yaml))" in markdown
    assert rows_by_method(rows)["SCAFFOLD"]["alpha-0.5:n"] == "3"

    # Fewer rounds than the runs reached: their final values are not the plan's.
    plan["configs"][1] = {"federation.rounds": 2}
    sweep.write_text(yaml.safe_dump(plan, sort_keys=False))
    markdown, rows, _ = run_table(sweep)
    assert rows_by_method(rows)["SCAFFOLD"]["alpha-0.5:n"] == "0"
    assert "alpha-0.5/SCAFFOLD/seed0 (federation.rounds: it logged round 4, past the 2 of the plan)" in markdown


def test_only_the_points_with_runs_are_resolved_and_a_refused_one_refuses_the_plan(sweep, capsys):
    # A method added after the runs, with a setting that fit refuses: while none of its points has a
    # run, its row is empty and the others are tabulated as before.
    plan = yaml.safe_load(sweep.read_text())
    plan["methods"]["FedProx"] = [{"algorithm": "fedprox", "algorithm.init_args.mu": "much"}]
    sweep.write_text(yaml.safe_dump(plan, sort_keys=False))
    _, rows, _ = run_table(sweep)
    assert rows_by_method(rows)["FedProx"]["alpha-0.5:n"] == "0"
    assert rows_by_method(rows)["SCAFFOLD"]["alpha-0.5:n"] == "3"
    # A run in one of its folders: the plan is refused, naming the point and the field.
    write_run(run_folder(sweep, "alpha-0.1", "fedprox", 1), [0.5, 0.6])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_table(sweep)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: plan: expected grid points whose settings fit accepts, got ")
    assert error.endswith("] FedProx | alpha-0.1 | seed 1: algorithm.mu: expected a finite number, got 'much'\n")


def test_a_torn_last_line_is_left_out_and_said(sweep, capsys):
    metrics = run_folder(sweep, "alpha-0.5", "fedavg", 0) / "metrics.jsonl"
    with open(metrics, "a") as handle:
        handle.write('{"round": 5, "train_lo')  # what a SIGKILL while appending leaves
    markdown, rows, _ = run_table(sweep)
    assert float(rows_by_method(rows)["FedAvg"]["alpha-0.5:mean"]) == pytest.approx(72.0)
    assert ("a torn last line of metrics.jsonl left out (a killed run; resuming it rewrites the line): "
            "alpha-0.5/FedAvg/seed0") in markdown
    # A bad line before the last is no kill's doing: refused, naming the file and the line.
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        run_table(sweep)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: runs: expected metrics.jsonl of one JSON object per round "
                                              f"(only a last line torn by a killed run is left out), got "
                                              f"'{metrics}, line 2'\n")


def test_a_metric_no_run_logged_is_an_error_listing_those_logged(sweep, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_table(sweep, "--metric", "test_acc")
    assert exit_info.value.code == 2
    # alpha-0.1/FedAvg + CONST/seed1 is unfinished: what its evaluations to come log is listed too.
    assert capsys.readouterr().err == ("error: metric: expected a metric the runs logged or will log at their "
                                       "evaluations to come: eval_seconds, round_seconds, test_accuracy, test_loss, "
                                       "train_loss, got 'test_acc'\n")


def test_an_early_stopped_run_counts_as_finished_at_its_last_round(sweep):
    # FedAvg + CONST, alpha 0.1, seed 1 stopped at round 2 of 4; its checkpoint records a final stop.
    folder = run_folder(sweep, "alpha-0.1", "fedavg+const", 1)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    state = {"round": 2, "model": {}, "algorithm": {}, "partition": [], "hyperparameters": config,
             "metrics": [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()],
             FINAL_STOP: "EarlyStopping: test_accuracy did not improve"}
    save_checkpoint(state, folder, keep=1)
    markdown, rows, _ = run_table(sweep)
    const = rows_by_method(rows)["FedAvg + CONST"]
    assert const["alpha-0.1:n"] == "3" and float(const["alpha-0.1:mean"]) == pytest.approx((60 + 90 + 62) / 3)
    assert ("finished early (a final stop in its checkpoint), counted at its last round: "
            "alpha-0.1/FedAvg + CONST/seed1 (round 2/4)") in markdown
    assert "not counted, unfinished" not in markdown


# --baseline: paired differences


T_975 = {2: 4.302653, 3: 3.182446}
"""Student's t, 0.975 quantile, by degrees of freedom (as statistics tables print it)."""
# setting -> method -> seed -> final test accuracy; the baseline is fedavg.
PAIRED_RUNS = {
    "alpha-0.5": {"fedavg": {0: 0.60, 1: 0.62, 2: 0.58, 3: 0.64},
                  "better": {0: 0.64, 1: 0.66, 2: 0.63, 3: 0.67},  # +4, +4, +5, +3 points: the interval excludes 0
                  "same": {0: 0.61, 1: 0.60, 2: 0.60, 3: 0.63},  # +1, -2, +2, -1: it does not
                  "extra": {0: 0.70, 1: 0.72, 2: 0.68, 3: 0.74, 4: 0.80}},  # +10 each, but seed 4 has no pair
    "alpha-0.1": {"fedavg": {0: 0.40, 1: 0.42},
                  "better": {0: 0.45, 1: 0.46},  # two pairs: no interval
                  "extra": {0: 0.41, 1: 0.43, 2: 0.50}},  # two pairs and seed 2 unpaired; "same" has no run here
}


def write_paired_runs(root: Path) -> None:
    for setting, methods in PAIRED_RUNS.items():
        for method, seeds in methods.items():
            for seed, accuracy in seeds.items():
                write_run(root / setting / method / f"seed{seed}", [accuracy - 0.1, accuracy])


def direct_interval(differences: list[float]) -> tuple[float, float]:
    mean, n = statistics.fmean(differences), len(differences)
    half = T_975[n - 1] * statistics.stdev(differences) / n ** 0.5
    return mean - half, mean + half


def test_baseline_gives_each_cell_its_paired_difference_and_95_percent_interval(tmp_path):
    write_paired_runs(tmp_path / "runs")
    out = tmp_path / "out"
    main(["table", "--plan", str(tmp_path / "runs" / "*" / "*" / "seed*"), "--baseline", "fedavg", "--out", str(out)])
    markdown = (out / "table.md").read_text()
    rows = rows_by_method(list(csv.DictReader(io.StringIO((out / "table.csv").read_text()))))
    lines = markdown.splitlines()
    assert lines[0] == "| method | α = 0.1 | vs fedavg | α = 0.5 | vs fedavg |"  # the folders' order
    paired_cells = {line.split(" | ")[0].removeprefix("| "): line.removesuffix(" |").split(" | ")[2::2]
                    for line in lines[2:6]}

    def differences(setting: str, method: str) -> list[float]:
        ours, base = PAIRED_RUNS[setting][method], PAIRED_RUNS[setting]["fedavg"]
        return [100 * (ours[seed] - base[seed]) for seed in sorted(ours.keys() & base.keys())]

    # Four pairs whose interval lies above 0: marked.
    better = differences("alpha-0.5", "better")
    low, high = direct_interval(better)
    assert low > 0
    cells = rows["better"]
    assert float(cells["alpha-0.5:paired_diff"]) == pytest.approx(statistics.fmean(better))
    # statistics.py's t is exact to its 4 decimals
    assert (float(cells["alpha-0.5:paired_low"]), float(cells["alpha-0.5:paired_high"])) == pytest.approx(
        (low, high), rel=1e-4)
    assert (cells["alpha-0.5:paired_n"], cells["alpha-0.5:paired_excludes_0"]) == ("4", "1")
    assert paired_cells["better"][1] == f"+{statistics.fmean(better):.2f} [+{low:.2f}, +{high:.2f}] *"
    # An interval across 0: not marked.
    same = differences("alpha-0.5", "same")
    low, high = direct_interval(same)
    assert low < 0 < high and rows["same"]["alpha-0.5:paired_excludes_0"] == "0"
    assert paired_cells["same"][1] == f"{statistics.fmean(same):+.2f} [{low:+.2f}, {high:+.2f}]"
    # Fewer than three pairs, or a seed without a pair: the mean difference alone, no interval, no mark.
    assert float(cells["alpha-0.1:paired_diff"]) == pytest.approx(statistics.fmean(differences("alpha-0.1", "better")))
    assert (cells["alpha-0.1:paired_n"], cells["alpha-0.1:paired_low"], cells["alpha-0.1:paired_excludes_0"]) == (
        "2", "", "")
    assert paired_cells["better"][0] == f"+{statistics.fmean(differences('alpha-0.1', 'better')):.2f} (2 pairs)"
    extra = rows["extra"]
    assert (extra["alpha-0.5:unpaired_seeds"], extra["alpha-0.5:paired_n"], extra["alpha-0.5:paired_low"],
            extra["alpha-0.5:paired_excludes_0"]) == ("4", "4", "", "")
    assert extra["alpha-0.1:unpaired_seeds"] == "2"
    assert paired_cells["extra"] == [f"+{statistics.fmean(differences('alpha-0.1', 'extra')):.2f} (2 pairs; seed 2 "
                                     "unpaired)", "+10.00 (4 pairs; seed 4 unpaired)"]
    assert paired_cells["fedavg"] == ["baseline", "baseline"] and paired_cells["same"][0] == "–"  # no run of same
    assert rows["fedavg"]["alpha-0.5:paired_diff"] == "" and rows["fedavg"]["baseline"] == "fedavg"
    assert ("vs fedavg: the mean over seeds of each run's test_accuracy minus that of the fedavg run of its seed (the "
            "same partition and client sampling), with its 95% confidence interval (Student's t, n − 1 degrees of "
            "freedom) from 3 pairs on, * where the interval excludes 0; with fewer pairs, or seeds without a pair, the "
            "mean difference alone and no mark.") in lines


def test_a_baseline_the_table_does_not_have_is_refused_naming_its_methods(sweep, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_table(sweep, "--baseline", "FedProx")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("error: baseline: expected a method of the table (FedAvg, FedAvg + CONST, "
                                       "SCAFFOLD), got 'FedProx'\n")


def test_two_run_folders_of_one_cell_and_seed_are_refused_not_counted_as_two_seeds(tmp_path, capsys):
    for plan in ("a", "b"):
        write_run(tmp_path / plan / "alpha-0.5" / "fedavg" / "seed0", [0.5, 0.6])
    with pytest.raises(SystemExit) as exit_info:
        main(["table", "--plan", str(tmp_path / "*" / "*" / "*" / "seed*"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: plan: expected run folders of one run per method, setting and seed (two runs of one seed are not "
        f"two seeds), got '{tmp_path / 'a/alpha-0.5/fedavg/seed0'} and {tmp_path / 'b/alpha-0.5/fedavg/seed0'}, both "
        "fedavg | alpha-0.5 | seed 0'\n")


def test_tables_of_other_metrics_and_rounds_are_written_beside_the_plans_and_say_which_they_are(plain_table, sweep):
    _, rows, out = plain_table
    assert {row["metric"] for row in rows} == {"test_accuracy"} and {row["at"] for row in rows} == {"final"}
    run_table(sweep)
    markdown, rows, out = run_table(sweep, "--metric", "test_loss", "--at", "last:2")
    assert "test_loss, mean of each run's last 2 evaluations (--metric test_loss --at last:2): " in markdown
    assert {row["metric"] for row in rows} == {"test_loss"} and {row["at"] for row in rows} == {"last:2"}
    assert sorted(path.name for path in out.iterdir()) == [
        "plot-test_loss-last2.png", "plot.png", "table-test_loss-last2.csv", "table-test_loss-last2.md", "table.csv",
        "table.md"]
    assert "(--metric test_accuracy --at final)" in (out / "table.md").read_text()  # the plan's, as it was


# compare


def write_compare_runs(tmp_path: Path) -> None:
    for name, accuracies in {"fedavg": [0.2, 0.5, 0.4], "ctpfl": [0.1, 0.3, 0.35]}.items():
        run = tmp_path / name
        run.mkdir()
        log = MetricsLog(run, history=[])
        for round_index, accuracy in enumerate(accuracies, start=1):
            log.append({"round": round_index, "train_loss": 1.0 - accuracy, "test_accuracy": accuracy})
        class_path = {"fedavg": "fl_lightning.algorithms.FedAvg", "ctpfl": "fl_lightning.algorithms.ctpfl.CTPFL"}[name]
        (run / "config.yaml").write_text(f"algorithm:\n  class_path: {class_path}\n")


def test_compare_tabulates_and_plots_local_runs(tmp_path, capsys):
    write_compare_runs(tmp_path)
    plot = tmp_path / "curves.png"
    main(["compare", "--runs", f"[{tmp_path / 'fedavg'}, {tmp_path / 'ctpfl'}]", "--plot", str(plot)])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["run", "method", "rounds", "final_test_accuracy", "best_test_accuracy",
                                  "best_test_accuracy_round", "best_test_accuracy_selected_on"]
    assert printed[1].split()[1:] == ["fedavg", "3", "0.4000", "0.5000", "2", "test_accuracy"]
    assert printed[2].split()[1:] == ["ctpfl", "3", "0.3500", "0.3500", "3", "test_accuracy"]
    # No validation split: the best was chosen on the test set, and the note under the table says so.
    assert printed[3] == ("best: selected on the test set itself, the best test_accuracy over the evaluations (no "
                          "val_accuracy logged: no validation split, data.validation), an optimistic number: "
                          "fedavg, ctpfl")
    assert plot.read_bytes()[:8] == PNG


def test_compare_best_loss_is_the_minimum(tmp_path, capsys):
    write_compare_runs(tmp_path)
    main(["compare", "--runs", f"[{tmp_path / 'fedavg'}]", "--metric", "train_loss"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[3:] == ["final_train_loss", "best_train_loss", "best_train_loss_round",
                                      "best_train_loss_selected_on"]
    # Losses 0.8, 0.5, 0.6: the best is not the 0.8. A metric that is not the test set's is its own best.
    assert printed[1].split()[3:] == ["0.6000", "0.5000", "2", "train_loss"]
    assert len(printed) == 2  # nor is any note due


def test_compare_takes_a_glob_and_labels_curves_by_folder(tmp_path, capsys, monkeypatch):
    write_compare_runs(tmp_path)
    (tmp_path / "notes.txt").write_text("not a run")
    labels = []
    monkeypatch.setattr("fl_lightning.compare._plot", lambda curves, metric, path: labels.extend(curves))
    main(["compare", "--runs", str(tmp_path / "*"), "--plot", str(tmp_path / "curves.png")])
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed[1:3]] == [str(tmp_path / "ctpfl"), str(tmp_path / "fedavg")]
    assert labels == ["ctpfl", "fedavg"]


def test_compare_rejects_a_folder_without_metrics(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--runs", f"[{tmp_path}]"])
    assert exit_info.value.code == 2
    assert "runs" in capsys.readouterr().err


def test_compare_rejects_a_glob_matching_no_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--runs", str(tmp_path / "*")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: runs: expected folders written by `fl-lightning fit`")


def test_compare_leaves_out_a_torn_last_line_and_refuses_a_metric_no_run_logged(tmp_path, capsys):
    write_compare_runs(tmp_path)
    with open(tmp_path / "fedavg" / "metrics.jsonl", "a") as handle:
        handle.write('{"round": 4, "train_lo')
    main(["compare", "--runs", f"[{tmp_path / 'fedavg'}]"])
    out, err = capsys.readouterr()
    assert out.splitlines()[1].split()[1:5] == ["fedavg", "3", "0.4000", "0.5000"]
    assert f"note: {tmp_path / 'fedavg'}: a torn last line of metrics.jsonl left out" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--runs", f"[{tmp_path / 'fedavg'}]", "--metric", "test_acc"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith("error: metric: expected a metric the runs logged: test_accuracy, "
                                            "train_loss, got 'test_acc'\n")


def write_seeded_runs(root: Path, method: str, finals: dict[int, list[float]], rounds: int = ROUNDS) -> None:
    """root/<method>/seed<k>: runs of one experiment (FedAvg, or FedProx with mu `method`), seed k's evaluations
    `finals[k]`."""
    algorithm = ({"class_path": "fl_lightning.algorithms.fedavg.FedAvg", "init_args": {}} if method == "fedavg" else
                 {"class_path": "fl_lightning.algorithms.fedprox.FedProx", "init_args": {"mu": float(method[2:])}})
    for seed, accuracies in finals.items():
        write_run(root / method / f"seed{seed}", accuracies,
                  config={"algorithm": algorithm, "federation": {"rounds": rounds}, "seed": seed})


def test_compare_pairs_each_experiment_with_the_baseline_seed_by_seed(tmp_path, capsys):
    write_seeded_runs(tmp_path, "fedavg", {0: [0.50, 0.60], 1: [0.55, 0.62], 2: [0.40, 0.58]})
    write_seeded_runs(tmp_path, "mu0.1", {0: [0.60, 0.66], 1: [0.70, 0.65], 2: [0.50, 0.63]})
    write_seeded_runs(tmp_path, "mu0.5", {0: [0.50, 0.61], 1: [0.50, 0.60]})  # no seed 2: no interval
    write_seeded_runs(tmp_path, "mu1.0", {0: [0.50, 0.61], 1: [0.50, 0.60], 2: [0.52]})  # seed 2 at round 2 of 4
    main(["compare", "--runs", str(tmp_path / "*" / "seed*"), "--baseline", str(tmp_path / "fedavg" / "seed*")])
    out = capsys.readouterr().out
    paired = out[out.index("\nminus the baseline "):].splitlines()[2:]
    assert paired[0].split() == ["runs", "seeds", "final_test_accuracy", "-", "baseline", "best_test_accuracy", "-",
                                 "baseline"]
    rows = {line.split()[0]: re.split(r"\s{2,}", line.strip()) for line in paired[1:4]}
    assert list(rows) == [str(tmp_path / name / "seed*") for name in ("mu0.1", "mu0.5", "mu1.0")]
    finals = [0.66 - 0.60, 0.65 - 0.62, 0.63 - 0.58]
    bests = [0.66 - 0.60, 0.70 - 0.62, 0.63 - 0.58]
    for column, differences in ((2, finals), (3, bests)):
        low, high = direct_interval(differences)
        assert rows[str(tmp_path / "mu0.1" / "seed*")][column] == (
            f"{statistics.fmean(differences):+.4f} [{low:+.4f}, {high:+.4f}]" + (" *" if low > 0 or high < 0 else ""))
    assert rows[str(tmp_path / "mu0.1" / "seed*")][2].endswith(" *")  # +0.03 to +0.06: above 0
    assert rows[str(tmp_path / "mu0.5" / "seed*")][1:3] == [
        "0, 1", f"{statistics.fmean([0.01, -0.02]):+.4f} (2 pairs; seed 2 unpaired)"]
    # A run at another round than the baseline's of its seed is not paired with it.
    assert rows[str(tmp_path / "mu1.0" / "seed*")][2].endswith(" (2 pairs; seed 2 unpaired)")
    assert paired[-1] == ("not paired, at other rounds than the baseline's run of its seed: "
                          f"{tmp_path / 'mu1.0' / 'seed2'} (round 2, the baseline's 4)")
    assert f"minus the baseline {tmp_path / 'fedavg' / 'seed*'} (seeds 0, 1, 2), seed by seed:" in out


def test_compare_refuses_a_baseline_of_several_experiments_or_two_runs_of_a_seed(tmp_path, capsys):
    write_seeded_runs(tmp_path, "fedavg", {0: [0.5, 0.6], 1: [0.5, 0.6]})
    write_seeded_runs(tmp_path, "mu0.1", {0: [0.5, 0.6]})
    runs = str(tmp_path / "*" / "seed*")
    for baseline, expected in [
            (f"[{tmp_path / 'fedavg' / 'seed0'}, {tmp_path / 'mu0.1' / 'seed0'}]",
             "error: baseline: expected the runs of one experiment (settings that differ only in the seed), one per "
             f"seed, got '{tmp_path / 'fedavg' / 'seed0'}; {tmp_path / 'mu0.1' / 'seed0'}'\n"),
            (str(tmp_path / "missing" / "seed*"),
             f"error: baseline: expected folders written by `fl-lightning fit` (with metrics.jsonl), got "
             f"'{tmp_path / 'missing' / 'seed*'}'\n")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["compare", "--runs", runs, "--baseline", baseline])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == expected
    shutil.copytree(tmp_path / "fedavg" / "seed1", tmp_path / "copy" / "seed1")  # the same experiment and seed
    with pytest.raises(SystemExit):
        main(["compare", "--runs", runs, "--baseline", str(tmp_path / "fedavg" / "seed*")])
    assert capsys.readouterr().err.startswith("error: runs: expected one run per experiment and seed (two runs of one "
                                              "seed are not two seeds), got ")


def test_compare_with_a_plan_leaves_out_runs_made_with_other_settings(sweep, capsys):
    changed = run_folder(sweep, "alpha-0.5", "scaffold", 2)
    config = yaml.safe_load((changed / "config.yaml").read_text())
    config["seed"] = 7
    (changed / "config.yaml").write_text(yaml.safe_dump(config))
    main(["compare", "--runs", str(sweep.parent / "runs" / "demo" / "alpha-0.5" / "scaffold" / "seed*"),
          "--plan", str(sweep), "--runs_root", str(sweep.parent / "runs")])
    out, err = capsys.readouterr()
    assert [line.split()[0] for line in out.splitlines()[1:3]] == [
        str(run_folder(sweep, "alpha-0.5", "scaffold", seed)) for seed in (0, 1)]
    assert out.splitlines()[3].endswith("an optimistic number: seed0, seed1")
    assert f"left out, made with other settings than their grid point's: {changed} (seed 7 -> 2 (config.yaml))" in err


def test_compare_with_a_plan_resolves_the_points_of_the_runs_compared_and_a_refused_one_refuses(sweep, capsys):
    # As in a table: a method whose settings fit refuses, with no run among those compared, is not resolved.
    plan = yaml.safe_load(sweep.read_text())
    plan["methods"]["FedProx"] = [{"algorithm": "fedprox", "algorithm.init_args.mu": "much"}]
    sweep.write_text(yaml.safe_dump(plan, sort_keys=False))
    runs_root = sweep.parent / "runs"
    main(["compare", "--runs", str(runs_root / "demo" / "alpha-0.5" / "scaffold" / "seed*"), "--plan", str(sweep),
          "--runs_root", str(runs_root)])
    assert len(capsys.readouterr().out.splitlines()) == 1 + 3 + 1  # the header, 3 runs, the note of their best
    refused = run_folder(sweep, "alpha-0.1", "fedprox", 1)
    write_run(refused, [0.5, 0.6])
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--runs", f"[{refused}]", "--plan", str(sweep), "--runs_root", str(runs_root)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: plan: expected grid points whose settings fit accepts")
    assert error.endswith("] FedProx | alpha-0.1 | seed 1: algorithm.mu: expected a finite number, got 'much'\n")


def test_compare_with_a_plan_none_of_whose_grid_points_is_among_the_runs_is_refused(sweep, capsys, monkeypatch):
    # Run from another folder without --runs_root: runs/ there holds no run of the plan, so nothing would be checked.
    elsewhere = sweep.parent / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    runs_root = sweep.parent / "runs"
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--runs", str(runs_root / "demo" / "alpha-0.5" / "scaffold" / "seed*"), "--plan", str(sweep)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: runs_root: expected the folder holding the run folders of plan demo (runs/demo/<setting>/<method>/"
        "seed<k>): --plan checks the runs compared that are its grid points, and none of the 3 is one under it (its "
        f"grid points' folders are under {runs_root.resolve()}: give that as --runs_root), got 'runs'\n")
    main(["compare", "--runs", str(runs_root / "demo" / "alpha-0.5" / "scaffold" / "seed*"), "--plan", str(sweep),
          "--runs_root", str(runs_root)])
    assert len(capsys.readouterr().out.splitlines()) == 1 + 3 + 1  # the header, 3 runs, the note of their best


def test_a_run_whose_metrics_rows_are_lost_is_named_with_its_checkpoint_and_the_command_that_rewrites_them(
        sweep, capsys):
    point = next(p for p in load_plan(sweep, runs_root=sweep.parent / "runs").grid()
                 if (p.setting_name, p.method, p.seed) == ("alpha-0.5", "FedAvg", 0))
    shutil.rmtree(point.out_dir)
    main(point.fit_arguments())  # trained for real: its checkpoints hold every round's row
    rows_logged = read_metrics(point.out_dir)
    (point.out_dir / "metrics.jsonl").write_text("")  # what a kill between a checkpoint and the log leaves
    markdown, rows, _ = run_table(sweep)
    assert rows_by_method(rows)["FedAvg"]["alpha-0.5:n"] == "2"
    config = point.out_dir / "config.yaml"
    assert (f"- alpha-0.5/FedAvg/seed0: no metrics rows (checkpoint at round {ROUNDS}): resume it to rewrite them "
            f"(fl-lightning fit --config {config})") in markdown.splitlines()
    assert "not started: alpha-0.1/FedAvg/seed2" in markdown and "alpha-0.5/FedAvg/seed0," not in markdown
    main(["fit", "--config", str(config)])  # the command given: a finished run, its rows rewritten
    assert read_metrics(point.out_dir) == rows_logged
    markdown, rows, _ = run_table(sweep)
    assert rows_by_method(rows)["FedAvg"]["alpha-0.5:n"] == "3" and "no metrics rows" not in markdown


def test_before_the_first_evaluation_the_plans_metric_is_pending_not_unknown(tmp_path, monkeypatch, capsys,
                                                                               point_configs):
    # A sweep under way: each run has logged round 1 of 4, none has reached its evaluation (at round 4);
    # SCAFFOLD at alpha 0.1 has not started.
    monkeypatch.chdir(tmp_path)
    plan_file = write_demo_plan(tmp_path)
    (tmp_path / "paper.csv").write_text("method,alpha-0.5,alpha-0.1\nFedAvg,71.50,\n")
    for point in load_plan(plan_file, runs_root=tmp_path / "runs").grid():
        if point.seed == 0 and (point.setting_name, point.method) != ("alpha-0.1", "SCAFFOLD"):
            write_run(point.out_dir, [], config={**point_configs[point.setting_name, point.method, point.seed],
                                                 "out_dir": str(point.out_dir)})
            MetricsLog(point.out_dir, history=[{"round": 1, "train_loss": 2.0, "round_seconds": 0.1}])
    for options in ([], ["--include_partial", "true"]):
        markdown, rows, _ = run_table(plan_file, *options)
        lines = markdown.splitlines()
        assert lines[2] == "| FedAvg | pending | 71.50 | – | pending | – | – |"
        assert lines[4] == "| SCAFFOLD | pending | – | – | – | – | – |"
        assert all(row[f"{setting}:n"] == "0" for row in rows for setting in ("alpha-0.5", "alpha-0.1"))
    assert ("pending, no test_accuracy logged yet (its evaluations are to come): alpha-0.5/FedAvg/seed0, "
            "alpha-0.5/SCAFFOLD/seed0") in markdown
    run_table(plan_file, "--metric", "test_loss")  # another metric an evaluation logs
    with pytest.raises(SystemExit) as exit_info:  # a metric no evaluation logs is still refused
        run_table(plan_file, "--metric", "test_acc")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith("error: metric: expected a metric the runs logged or will log at their "
                                            "evaluations to come: eval_seconds, round_seconds, test_accuracy, "
                                            "test_loss, train_loss, got 'test_acc'\n")
    main(["compare", "--runs", str(tmp_path / "runs" / "demo" / "alpha-0.5" / "*" / "seed0")])
    assert capsys.readouterr().out.splitlines()[1].split()[1:] == ["fedavg+const", "1", "None", "None", "None", "None"]


def test_the_metrics_to_come_are_what_an_evaluation_logs(tmp_path):
    out = tmp_path / "run"
    main(["fit", "--config", str(REPOSITORY / "configs" / "quickstart.yaml"), "--model.options", "{hidden: 16}",
          "--federation.rounds", "1", "--federation.local_steps", "1", "--data.validation", "0.2",
          "--data.per_client_eval", "true", "--out_dir", str(out)])
    (row,) = read_metrics(out)
    assert RunFolder(out).metrics_to_come() == set()  # finished: nothing is to come
    (out / "metrics.jsonl").write_text("")  # as before its first round
    assert set(row) - {"round", "train_loss", "round_seconds"} == RunFolder(out).metrics_to_come()


def test_compare_names_a_run_by_its_method_or_by_its_plans_method(sweep, capsys):
    runs = str(sweep.parent / "runs" / "demo" / "alpha-0.5" / "*" / "seed0")
    # As fit names them (their W&B tag method=): the algorithm's short name, "+const" with the constraint.
    assert [row["method"] for row in compare(runs)] == ["fedavg+const", "fedavg", "scaffold"]  # folders sorted
    rows = compare(runs, plan=sweep, runs_root=sweep.parent / "runs")
    assert [row["method"] for row in rows] == ["FedAvg + CONST", "FedAvg", "SCAFFOLD"]
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()[1:4]] == [
        "fedavg+const", "fedavg", "scaffold"]  # printed as returned
