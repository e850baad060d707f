"""`fl-lightning table` on run folders written by hand (no training)."""

import csv
import importlib
import io
import json
import shutil
import statistics
import sys
from pathlib import Path

import pytest
import yaml
from hand_written_runs import (
    PNG,
    ROUNDS,
    RUNS,
    rows_by_method,
    run_folder,
    write_checkpoint,
    write_demo_plan,
    write_plan_runs,
    write_run,
    write_sweep,
)
from paths import REPOSITORY

from fl_lightning.commands.main import main
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.results.plot import mean_curve
from fl_lightning.experiments.results.table import table, table_files
from fl_lightning.experiments.results.table_cells import order_methods
from fl_lightning.experiments.results.table_sources import setting_label
from fl_lightning.experiments.runs import RunFolder, value_at
from fl_lightning.metric_names import Best, best_round
from fl_lightning.run_logging import MetricsLog, read_metrics

pytestmark = pytest.mark.slow  # end to end: the tests train runs in-process or in subprocesses


# (setting, method) -> seed -> (accuracies at rounds 2 and 4, test losses); a run with one


@pytest.fixture(scope="module")
def plain_table(tmp_path_factory, point_configs):
    """`fl-lightning table` of the unchanged sweep with no options, made once for the tests that only
    read its rows."""
    folder = tmp_path_factory.mktemp("sweep")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        return run_table(write_sweep(folder, point_configs))


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
    assert capsys.readouterr().err.startswith("error: at: expected final, best, last:K")


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
    write_checkpoint(folder, 2, config, final_stop="EarlyStopping: test_accuracy did not improve",
                     metrics=[json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()])
    markdown, rows, _ = run_table(sweep)
    const = rows_by_method(rows)["FedAvg + CONST"]
    assert const["alpha-0.1:n"] == "3" and float(const["alpha-0.1:mean"]) == pytest.approx((60 + 90 + 62) / 3)
    assert ("finished early (a final stop in its checkpoint), counted at its last round: "
            "alpha-0.1/FedAvg + CONST/seed1 (round 2/4)") in markdown
    assert "not counted, unfinished" not in markdown


def test_a_finished_run_of_a_users_model_is_tabulated_without_importing_it(tmp_path, monkeypatch):
    # The plan names a model factory in a module of the user's, on sys.path while the runs are made only.
    user = tmp_path / "user"
    user.mkdir()
    shutil.copy(REPOSITORY / "examples" / "my_model.py", user / "table_users_model.py")
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({
        "name": "users", "configs": [str(REPOSITORY / "configs" / "quickstart.yaml"),
                                     {"federation.rounds": ROUNDS, "model.name": "table_users_model.make_net",
                                      "model.options": {"width": 8}}],
        "methods": {"FedAvg": [{"algorithm": "fedavg"}]}, "seeds": [0, 1],
        "settings": {"alpha": {"0.5": [{"data.alpha": 0.5}]}}}, sort_keys=False))
    monkeypatch.syspath_prepend(str(user))
    write_plan_runs(plan_file, tmp_path / "runs", [0.3, 0.5])
    monkeypatch.setattr(sys, "path", [path for path in sys.path if path != str(user)])
    monkeypatch.delitem(sys.modules, "table_users_model")
    importlib.invalidate_caches()
    markdown, rows, _ = run_table(plan_file)
    fedavg = rows_by_method(rows)["FedAvg"]
    assert fedavg["alpha-0.5:n"] == "2" and float(fedavg["alpha-0.5:mean"]) == pytest.approx(50.5)
    assert ("read as they recorded themselves, not checked against the plan's settings (table_users_model is not "
            "importable here: with its folder on PYTHONPATH they are): alpha-0.5/FedAvg/seed0, alpha-0.5/FedAvg/seed1"
            ) in markdown


# --baseline (its pairs and intervals: test_table_baseline.py)


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




def add_grad_evals(plan_file: Path, per_round: dict[str, int]) -> None:
    """Every run of the sweep logs cost_grad_evals, `per_round[method]` a round."""
    for method_folder in (plan_file.parent / "runs" / "demo").glob("*/*"):
        for metrics in method_folder.glob("seed*/metrics.jsonl"):
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            metrics.write_text("".join(json.dumps({**row, "cost_grad_evals": per_round[method_folder.name]
                                                   * row["round"]}) + "\n" for row in rows))


def test_at_a_budget_each_run_gives_its_last_evaluation_within_it_and_one_short_of_it_none(sweep):
    """Evaluations at rounds 2 and 4: SCAFFOLD's (200 a round) at 400 and 800 give round 2's value at
    grad_evals=450; FedAvg's (100 a round) end at 400, short of the budget: no value, never round 4's."""
    add_grad_evals(sweep, {"fedavg": 100, "scaffold": 200, "fedavg+const": 50})
    markdown, rows, _ = run_table(sweep, "--at", "grad_evals=450")
    cells = rows_by_method(rows)
    for setting in ("alpha-0.5", "alpha-0.1"):
        round_two = [accuracies[0] for accuracies, _ in RUNS[setting, "SCAFFOLD"].values()]
        assert float(cells["SCAFFOLD"][f"{setting}:mean"]) == pytest.approx(100 * statistics.fmean(round_two))
        assert cells["FedAvg"][f"{setting}:mean"] == ""
    assert "at the last evaluation within grad_evals = 450 (--metric test_accuracy --at grad_evals=450)" in markdown
    assert ("not reached, no value: their evaluations of test_accuracy end short of --at's budget (or they logged "
            "no cost counters): alpha-0.5/FedAvg/seed0, alpha-0.5/FedAvg/seed1") in markdown
