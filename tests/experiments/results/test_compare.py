"""`fl-lightning compare` on run folders written by hand (no training): its table and plot, the best by the one
rule, refused inputs, runs paired with a baseline by seed, and the runs of a plan."""

import json
import re
import shutil
import statistics

import pytest
import yaml
from hand_written_runs import PNG, direct_interval, run_folder, write_compare_runs, write_run, write_seeded_runs

from fl_lightning.commands.main import main
from fl_lightning.experiments.results.compare import compare
from fl_lightning.experiments.results.cost_axes import axis_label

pytestmark = pytest.mark.slow  # end to end: the command line in-process, on run folders and plans


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
    monkeypatch.setattr("fl_lightning.experiments.results.compare._plot",
                        lambda curves, metric, path, x: labels.extend(curves))
    main(["compare", "--runs", str(tmp_path / "*"), "--plot", str(tmp_path / "curves.png")])
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed[1:3]] == [str(tmp_path / "ctpfl"), str(tmp_path / "fedavg")]
    assert labels == ["ctpfl", "fedavg"]


def test_compare_on_a_cost_axis_plots_against_what_each_run_spent_and_says_it(tmp_path, capsys, monkeypatch):
    write_compare_runs(tmp_path)
    for name, a_round in {"fedavg": (100, 50), "ctpfl": (100, 20)}.items():  # bytes up, bytes down
        metrics = tmp_path / name / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps({**row, "cost_upload_bytes": a_round[0] * row["round"],
                                               "cost_download_bytes": a_round[1] * row["round"]}) + "\n"
                                   for row in rows))
    plotted = {}
    monkeypatch.setattr("fl_lightning.experiments.results.compare._plot",
                        lambda curves, metric, path, x: plotted.update(curves, x=x))
    main(["compare", "--runs", str(tmp_path / "*"), "--x", "bytes", "--plot", str(tmp_path / "curves.png")])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[:4] == ["run", "method", "rounds", "bytes"]
    assert printed[1].split()[1:4] == ["ctpfl", "3", "360"] and printed[2].split()[1:4] == ["fedavg", "3", "450"]
    assert plotted == {"x": "bytes", "fedavg": [(150, 0.2), (300, 0.5), (450, 0.4)],
                       "ctpfl": [(120, 0.1), (240, 0.3), (360, 0.35)]}
    assert axis_label("bytes") == "bytes (bytes sent up and down)"
    monkeypatch.undo()  # the real plot
    main(["compare", "--runs", str(tmp_path / "*"), "--x", "bytes", "--plot", str(tmp_path / "real.png")])
    assert (tmp_path / "real.png").read_bytes()[:8] == PNG


def test_compare_refuses_an_axis_that_is_none_before_reading_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--runs", str(tmp_path / "none"), "--x", "flops"])
    assert exit_info.value.code == 2 and "x: expected an axis of rounds, samples" in capsys.readouterr().err


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


def test_compare_names_a_run_by_its_method_or_by_its_plans_method(sweep, capsys):
    runs = str(sweep.parent / "runs" / "demo" / "alpha-0.5" / "*" / "seed0")
    # As fit names them (their W&B tag method=): the algorithm's short name, "+const" with the constraint.
    assert [row["method"] for row in compare(runs)] == ["fedavg+const", "fedavg", "scaffold"]  # folders sorted
    rows = compare(runs, plan=sweep, runs_root=sweep.parent / "runs")
    assert [row["method"] for row in rows] == ["FedAvg + CONST", "FedAvg", "SCAFFOLD"]
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()[1:4]] == [
        "fedavg+const", "fedavg", "scaffold"]  # printed as returned
