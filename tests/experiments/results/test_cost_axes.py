"""`table --target METRIC=VALUE --x AXIS` and `--x` on hand-written runs: the cost to reach a target, runs that
never reach it, the paired ratio to a baseline against a direct computation, and the refusals."""

import csv
import io
import json
import math
import statistics
from pathlib import Path

import pytest
from hand_written_runs import PNG, RUNS, direct_interval, rows_by_method, write_run

from fl_lightning.commands.main import main
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.results.cost_axes import Target, parse_axis
from fl_lightning.experiments.results.plot import mean_curve
from fl_lightning.experiments.results.table import table, table_files
from fl_lightning.experiments.runs import RunFolder

FOLDERS = {"FedAvg": "fedavg", "SCAFFOLD": "scaffold", "FedAvg + CONST": "fedavg+const"}
TARGET = 0.72
"""Of the demo sweep's α = 0.5 runs (evaluated at rounds 2 and 4), FedAvg's seed 0 never reaches it, its seed
1 at round 2; every SCAFFOLD and FedAvg + CONST run at round 4; none of α = 0.1's finished runs."""


def grad_evals_a_round(method: str, seed: int) -> int:
    """What each hand-written run spends a round: a rate of its own per method and seed."""
    return {"fedavg": 40 + 10 * seed, "scaffold": 100 + 10 * seed, "fedavg+const": 50 + 30 * seed}[method]


def add_grad_evals(plan_file: Path) -> None:
    for metrics in (plan_file.parent / "runs" / "demo").glob("*/*/seed*/metrics.jsonl"):
        rate = grad_evals_a_round(metrics.parent.parent.name, int(metrics.parent.name[4:]))
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps({**row, "cost_grad_evals": rate * row["round"]}) + "\n"
                                   for row in rows))


def direct_cost(setting: str, method: str, seed: int):
    """The grad_evals of the first evaluation at or above TARGET, from RUNS (evaluations at rounds 2, 4)."""
    accuracies, _ = RUNS[setting, method][seed]
    rounds = [2 * (index + 1) for index, accuracy in enumerate(accuracies) if accuracy >= TARGET]
    return rounds[0] * grad_evals_a_round(FOLDERS[method], seed) if rounds else None


def target_table(plan_file: Path, *options: str) -> tuple[str, dict[str, dict]]:
    out = plan_file.parent / "out"
    main(["table", "--plan", str(plan_file), "--runs_root", str(plan_file.parent / "runs"), "--out", str(out),
          "--target", f"test_accuracy={TARGET}", "--x", "grad_evals", *options])
    files = table_files(out, "test_accuracy", "final", "test_accuracy", Target("test_accuracy", TARGET, "grad_evals"))
    assert files["md"].name == "table-test_accuracy-to-0.72-grad_evals.md"
    return files["md"].read_text(), rows_by_method(csv.DictReader(io.StringIO(files["csv"].read_text())))


@pytest.mark.slow
def test_each_cell_is_the_cost_to_reach_the_target_and_runs_that_never_do_are_counted(sweep):
    add_grad_evals(sweep)
    markdown, rows = target_table(sweep)
    for method in FOLDERS:
        for setting in ("alpha-0.5", "alpha-0.1"):
            finished = [seed for seed, (accuracies, _) in RUNS[setting, method].items() if len(accuracies) == 2]
            costs = [cost for seed in finished if (cost := direct_cost(setting, method, seed)) is not None]
            row = rows[method]
            assert int(row[f"{setting}:n"]) == len(costs)
            assert int(row[f"{setting}:not_reached"]) == len(finished) - len(costs)
            assert float(row[f"{setting}:mean"] or "nan") == pytest.approx(
                statistics.fmean(costs) if costs else math.nan, nan_ok=True)
    fedavg = rows["FedAvg"]
    assert float(fedavg["alpha-0.5:mean"]) == pytest.approx((50 * 2 + 60 * 4) / 2)  # seeds 1 and 2; seed 0 never
    assert "| FedAvg | 170 ± 99 (2); not reached by 1 of 3 | not reached by 2 of 2 |" in markdown
    # The lowest mean is FedAvg's, over the two runs of three that reached it: FedAvg + CONST's is bold.
    assert fedavg["alpha-0.5:best"] == "0" and rows["FedAvg + CONST"]["alpha-0.5:best"] == "1"
    assert "**320 ± 120** (3)" in markdown
    assert (fedavg["target"], fedavg["x"]) == ("test_accuracy=0.72", "grad_evals")
    assert ("grad_evals (gradient evaluations) to reach test_accuracy ≥ 0.72 (--target test_accuracy=0.72 --x "
            "grad_evals): each run's grad_evals at its first evaluation at or above 0.72") in markdown
    assert ("never reached the target, counted in their cells as not reached (no evaluation of test_accuracy met "
            "--target): alpha-0.5/FedAvg/seed0, ") in markdown


@pytest.mark.slow
def test_the_paired_ratio_to_the_baseline_is_over_the_seeds_both_reached_with_its_log_scale_interval(sweep):
    add_grad_evals(sweep)
    markdown, rows = target_table(sweep, "--baseline", "SCAFFOLD", "--format", "latex")
    const = rows["FedAvg + CONST"]
    logs = [math.log(direct_cost("alpha-0.5", "FedAvg + CONST", seed) / direct_cost("alpha-0.5", "SCAFFOLD", seed))
            for seed in (0, 1, 2)]
    low, high = direct_interval(logs)
    assert float(const["alpha-0.5:paired_ratio"]) == pytest.approx(math.exp(statistics.fmean(logs)))
    assert (float(const["alpha-0.5:paired_low"]), float(const["alpha-0.5:paired_high"])) == pytest.approx(
        (math.exp(low), math.exp(high)), rel=1e-4)
    assert const["alpha-0.5:paired_excludes_1"] == str(int(math.exp(high) < 1 or math.exp(low) > 1))
    fedavg = rows["FedAvg"]  # seed 0 never reached it: 2 pairs, no interval
    assert fedavg["alpha-0.5:paired_n"] == "2" and fedavg["alpha-0.5:unpaired_seeds"] == "0"
    assert float(fedavg["alpha-0.5:paired_ratio"]) == pytest.approx(math.sqrt((100 / 440) * (240 / 480)))
    assert "| FedAvg | 170 ± 99 (2); not reached by 1 of 3 | 0.34 (2 pairs; seed 0 unpaired) |" in markdown
    assert "| FedAvg + CONST | **320 ± 120** (3) | 0.69 [0.32, 1.48] |" in markdown
    assert ("not paired with the baseline, their run and the SCAFFOLD run of their seed not both having reached "
            "test_accuracy ≥ 0.72: alpha-0.5/FedAvg/seed0 (not reached by its run), alpha-0.1/FedAvg/seed0 (not "
            "reached by its run, not reached by SCAFFOLD's run)") in markdown
    assert "alpha-0.1/FedAvg/seed2 (not reached by SCAFFOLD's run, no run of its own counted)" in markdown
    tex = (sweep.parent / "out" / "table-test_accuracy-to-0.72-grad_evals.tex").read_text()
    assert "Gradient evaluations (grad\\_evals) to reach test\\_accuracy $\\geq$ 0.72" in tex
    assert "interval excludes 1" in tex and "not reached by 1 of 3" in tex


def test_the_cost_of_a_loss_target_is_its_first_evaluation_at_or_below_it(tmp_path):
    write_run(tmp_path / "run", [0.5, 0.6, 0.7], losses=[1.5, 0.9, 1.0])
    run = RunFolder(tmp_path / "run")
    assert Target("test_loss", 1.0, "rounds").cost(run) == 4  # 0.9 at round 4, not 1.0 at round 6
    assert Target("test_accuracy", 0.7, "rounds").cost(run) == 6  # at or above: the value itself
    assert Target("test_accuracy", 0.71, "rounds").cost(run) is None
    assert Target("test_accuracy", 0.71, "rounds").missed(run)
    assert not Target("test_accuracy", 0.5, "grad_evals").missed(run)  # no counters: nothing to miss on the axis


GOAL = "test_accuracy=0.5"


@pytest.mark.parametrize(("options", "field"), [
    ({"target": "test_accuracy"}, "target"), ({"target": "=0.5"}, "target"), ({"target": "test_loss=inf"}, "target"),
    ({"target": "test_accuracy=half"}, "target"), ({"target": GOAL, "x": "flops"}, "x"), ({"x": "epochs"}, "x"),
    ({"target": GOAL, "metric": "test_loss"}, "metric"), ({"target": GOAL, "at": "best"}, "at"),
    ({"target": GOAL, "reference": "p.csv"}, "reference")])
def test_a_bad_target_or_axis_is_refused_naming_it_before_any_run_is_read(tmp_path, options, field):
    with pytest.raises(ConfigError) as refused:
        table(str(tmp_path / "no-such-plan.yaml"), **options)
    assert refused.value.field_name == field


def test_on_a_cost_axis_the_mean_curve_is_taken_evaluation_by_evaluation():
    runs = [[(100, 0.2), (200, 0.4)], [(120, 0.4), (240, 0.6)]]
    xs, means, lower, upper = mean_curve(runs, "minmax", "grad_evals")
    assert (xs, means, lower, upper) == (pytest.approx([110, 220]), pytest.approx([0.3, 0.5]), [0.2, 0.4], [0.4, 0.6])
    assert parse_axis("bytes") == "bytes"


@pytest.mark.slow
def test_x_puts_the_table_curves_on_the_cost_axis(sweep):
    add_grad_evals(sweep)
    result = table(str(sweep), runs_root=sweep.parent / "runs", out=sweep.parent / "out", x="grad_evals")
    # Beside the plan's table and its plot on the round, never over them.
    assert (sweep.parent / "out" / "plot-test_accuracy-final-grad_evals.png").read_bytes()[:8] == PNG
    assert not (sweep.parent / "out" / "plot.png").exists()
    curves = result.curves["SCAFFOLD", "alpha-0.5"]
    assert sorted(curves) == sorted([[(2 * grad_evals_a_round("scaffold", seed), 100 * accuracies[0]),
                                      (4 * grad_evals_a_round("scaffold", seed), 100 * accuracies[1])]
                                     for seed, (accuracies, _) in RUNS["alpha-0.5", "SCAFFOLD"].items()])
    # A table of costs to a target draws every run it counts, those that never reached it too.
    result = table(str(sweep), runs_root=sweep.parent / "runs", out=sweep.parent / "out", x="grad_evals",
                   target=f"test_accuracy={TARGET}")
    assert len(result.curves["FedAvg", "alpha-0.1"]) == 2 and result.cells["FedAvg", "alpha-0.1"].n == 0
