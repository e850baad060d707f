"""`fl-lightning table --baseline`: each cell's paired difference to the baseline and its 95% interval,
end to end on run folders written by hand, checked against a direct computation in the test."""

import csv
import io
import statistics
from pathlib import Path

import pytest
from hand_written_runs import direct_interval, rows_by_method, write_run

from fl_lightning.commands.main import main

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


# setting -> method -> seed -> its evaluations (rounds 2 and 4 of ROUNDS; one evaluation: stopped at round 2).
PARTIAL_RUNS = {
    "alpha-0.5": {"fedavg": {0: [0.5, 0.60], 1: [0.5, 0.62], 2: [0.5, 0.58], 3: [0.5, 0.64]},
                  "better": {0: [0.5, 0.64], 1: [0.30], 2: [0.5, 0.63], 3: [0.5, 0.67]}},  # seed 1 at round 2
    "alpha-0.1": {"fedavg": {0: [0.3, 0.40], 1: [0.3, 0.42], 2: [0.70], 3: [0.3, 0.41]},  # the baseline's seed 2
                  "better": {0: [0.3, 0.45], 1: [0.3, 0.46], 2: [0.3, 0.47], 3: [0.3, 0.44]}},
    "alpha-0.3": {"fedavg": {0: [0.30], 1: [0.3, 0.42], 2: [0.3, 0.40], 3: [0.3, 0.41]},  # both seed 0 at round 2
                  "better": {0: [0.35], 1: [0.3, 0.46], 2: [0.3, 0.45], 3: [0.3, 0.44]}},
}


def test_include_partial_never_pairs_runs_at_other_rounds(tmp_path):
    for setting, methods in PARTIAL_RUNS.items():
        for method, seeds in methods.items():
            for seed, evaluations in seeds.items():
                write_run(tmp_path / "runs" / setting / method / f"seed{seed}", evaluations)
    out = tmp_path / "out"
    main(["table", "--plan", str(tmp_path / "runs" / "*" / "*" / "seed*"), "--baseline", "fedavg", "--out", str(out),
          "--include_partial", "true"])
    rows = rows_by_method(list(csv.DictReader(io.StringIO((out / "table.csv").read_text()))))
    markdown = (out / "table.md").read_text()

    def paired(setting: str, seeds: list[int]) -> list[float]:
        ours, base = PARTIAL_RUNS[setting]["better"], PARTIAL_RUNS[setting]["fedavg"]
        return [100 * (ours[seed][-1] - base[seed][-1]) for seed in seeds]

    better = rows["better"]
    # A run of either side at round 2 of 4 is not paired with its seed's finished run: no interval, no mark.
    for setting, apart in (("alpha-0.5", 1), ("alpha-0.1", 2)):
        seeds = [seed for seed in range(4) if seed != apart]
        assert float(better[f"{setting}:paired_diff"]) == pytest.approx(statistics.fmean(paired(setting, seeds)))
        assert (better[f"{setting}:paired_n"], better[f"{setting}:unpaired_seeds"], better[f"{setting}:paired_low"],
                better[f"{setting}:paired_excludes_0"]) == ("3", str(apart), "", "")
        assert f"({3} pairs; seed {apart} unpaired)" in markdown
    # Two runs of one seed at the same round are a pair.
    differences = paired("alpha-0.3", [0, 1, 2, 3])
    low, high = direct_interval(differences)
    assert (better["alpha-0.3:paired_n"], better["alpha-0.3:unpaired_seeds"]) == ("4", "")
    assert (float(better["alpha-0.3:paired_low"]), float(better["alpha-0.3:paired_high"])) == pytest.approx(
        (low, high), rel=1e-4)
    assert ("not paired with the baseline, its run and the baseline's of its seed at other rounds (the values of an "
            "unfinished run, --include_partial, are of the round it has reached): alpha-0.1/better/seed2 finished, "
            "fedavg's at round 2, alpha-0.5/better/seed1 at round 2, fedavg's finished") in markdown
