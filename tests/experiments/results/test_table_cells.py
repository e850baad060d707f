"""The cells of a table and the table laid out (fl_lightning.experiments.results.table_cells): a cell's
statistics over seeds, the best of a column, the paired difference to a baseline and its wording,
and the Markdown and CSV of a table built here by hand, checked against values computed in the test."""

import csv
import io
import math

import pytest

from fl_lightning.experiments.results.statistics import PairedDifference, paired_difference, paired_ratio
from fl_lightning.experiments.results.table_cells import (
    PAIRED_COLUMNS,
    Cell,
    Table,
    mark_best,
    pair_with_baseline,
    paired_difference_parts,
    paired_difference_text,
    shown_interval,
)

T_975 = {2: 4.302653, 3: 3.182446}
"""Student's t, 0.975 quantile, by degrees of freedom (as statistics tables print it)."""


def signed(value: float) -> str:
    return f"{value:+.2f}"


def sample_std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1))


def demo_table(**options) -> Table:
    """FedAvg and SCAFFOLD at two settings, SCAFFOLD's second still training, FedAvg the baseline."""
    cells = {("FedAvg", "alpha-0.5"): Cell({0: 70.0, 1: 72.0, 2: 71.0}, paper=71.2),
             ("FedAvg", "alpha-0.1"): Cell({0: 60.0, 1: 61.0}),
             ("SCAFFOLD", "alpha-0.5"): Cell({0: 74.0, 1: 75.0, 2: 76.0}, paper=73.0),
             ("SCAFFOLD", "alpha-0.1"): Cell(pending=True)}
    settings = ["alpha-0.5", "alpha-0.1"]
    for setting in settings:
        mark_best([cells["FedAvg", setting], cells["SCAFFOLD", setting]], "test_accuracy", 2)
    baseline_of = {"SCAFFOLD": "FedAvg"}
    pair_with_baseline(cells, baseline_of, settings)
    arguments = dict(metric="test_accuracy", at="final", methods=["FedAvg", "SCAFFOLD"], settings=settings,
                     labels={"alpha-0.5": "α = 0.5", "alpha-0.1": "α = 0.1"}, cells=cells,
                     curves={key: [] for key in cells}, percent=True, decimals=2, reference=True,
                     notes=["a note"], baseline="FedAvg", baseline_of=baseline_of)
    arguments.update(options)
    return Table(**arguments)


# Cells


def test_a_cells_mean_and_sample_std_over_its_seeds():
    values = [70.0, 74.0, 75.0]
    cell = Cell(dict(enumerate(values)), paper=71.2)
    assert cell.n == 3
    assert cell.mean == pytest.approx(73.0)
    assert cell.std == pytest.approx(sample_std(values))  # ddof = 1: sqrt(14 / 2)
    assert cell.std == pytest.approx(math.sqrt(7))
    assert cell.diff == pytest.approx(73.0 - 71.2)


def test_one_seed_has_no_std_and_no_seed_has_no_mean():
    assert Cell({3: 70.0}).std is None and Cell({3: 70.0}).mean == 70.0
    empty = Cell(paper=70.0)
    assert (empty.n, empty.mean, empty.std, empty.diff) == (0, None, None, None)
    assert Cell({0: 1.0}).diff is None  # no paper number to compare with


def test_a_cells_text_shows_mean_std_and_seed_count_with_the_best_in_bold():
    table = demo_table()
    assert table.cell_text(Cell({0: 70.0, 1: 72.0})) == "71.00 ± 1.41 (2)"
    assert table.cell_text(Cell({0: 70.0})) == "70.00 (1)"
    assert table.cell_text(Cell({0: 70.0}, best=True)) == "**70.00** (1)"
    assert table.cell_text(Cell()) == "–"
    assert table.cell_text(Cell(pending=True)) == "pending"


def test_numbers_take_the_tables_decimals_and_a_sign_where_asked():
    table = demo_table(decimals=4)
    assert table.number(0.123456) == "0.1235"
    assert table.number(0.5, sign=True) == "+0.5000"
    assert table.number(-0.5, sign=True) == "-0.5000"
    assert table.number(None) == "–" and table.number(None, sign=True) == "–"


# The best of a column


def test_the_highest_mean_of_an_accuracy_is_best_and_ties_at_the_shown_decimals_share_it():
    cells = [Cell({0: 70.004}), Cell({0: 70.001}), Cell({0: 69.99}), Cell()]
    mark_best(cells, "test_accuracy", 2)
    # 70.004 and 70.001 both show as 70.00: a reader could not tell which is higher.
    assert [cell.best for cell in cells] == [True, True, False, False]
    mark_best(cells, "test_accuracy", 3)
    assert [cell.best for cell in cells] == [True, False, False, False]


def test_the_lowest_mean_of_a_loss_is_best():
    cells = [Cell({0: 0.9, 1: 0.7}), Cell({0: 0.6}), Cell({0: 1.2})]
    mark_best(cells, "test_loss", 4)
    assert [cell.best for cell in cells] == [False, True, False]


def test_a_column_without_values_has_no_best():
    cells = [Cell(), Cell(pending=True)]
    mark_best(cells, "test_accuracy", 2)
    assert not any(cell.best for cell in cells)


# Paired differences


def test_each_compared_row_is_paired_with_its_baseline_seed_by_seed():
    cells = {("base", "s"): Cell({0: 60.0, 1: 62.0, 2: 58.0}), ("new", "s"): Cell({0: 64.0, 1: 63.0, 3: 70.0}),
             ("other", "s"): Cell({0: 1.0})}
    pair_with_baseline(cells, {"new": "base"}, ["s"])
    versus = cells["new", "s"].versus
    assert versus.seeds == [0, 1] and versus.unpaired == [2, 3]
    assert versus.differences == pytest.approx([4.0, 1.0])
    assert cells["base", "s"].versus is None and cells["other", "s"].versus is None


def test_a_difference_with_enough_pairs_shows_its_95_percent_interval_and_marks_one_that_excludes_zero():
    differences = [4.0, 3.0, 5.0]
    half = T_975[2] * sample_std(differences) / math.sqrt(3)
    text = paired_difference_text(PairedDifference(differences, [0, 1, 2], []), signed)
    assert text == f"+4.00 [{4 - half:+.2f}, {4 + half:+.2f}] *"
    assert text == "+4.00 [+1.52, +6.48] *"


def test_an_interval_that_holds_zero_is_shown_without_the_mark():
    differences = [1.0, -2.0, 2.0, -1.0]
    half = T_975[3] * sample_std(differences) / 2
    text = paired_difference_text(PairedDifference(differences, [0, 1, 2, 3], []), signed, mark=" †")
    assert text == f"+0.00 [{-half:+.2f}, {half:+.2f}]"
    assert text == "+0.00 [-2.91, +2.91]"
    marked = paired_difference_text(PairedDifference([4.0, 3.0, 5.0], [0, 1, 2], []), signed, mark=" †")
    assert marked.endswith("] †")


def test_too_few_pairs_show_the_mean_and_the_pairs_counted():
    assert paired_difference_text(PairedDifference([1.0, 2.0], [0, 1], []), signed) == "+1.50 (2 pairs)"
    assert paired_difference_text(PairedDifference([-1.0], [4], []), signed) == "-1.00 (1 pair)"


def test_unpaired_seeds_withhold_the_interval_and_are_named():
    # The pairs left are only the seeds both happened to finish: no interval is shown over them.
    versus = PairedDifference([4.0, 3.0, 5.0], [0, 1, 2], [3])
    assert shown_interval(versus) is None and versus.interval is not None
    assert paired_difference_text(versus, signed) == "+4.00 (3 pairs; seed 3 unpaired)"
    versus = PairedDifference([4.0], [0], [2, 5])
    assert paired_difference_text(versus, signed) == "+4.00 (1 pair; seeds 2, 5 unpaired)"


def test_no_pair_at_all_is_said_or_dashed():
    assert paired_difference_text(PairedDifference([], [], [1, 2]), signed) == "no seed paired"
    assert paired_difference_text(PairedDifference([], [], []), signed) == "–"
    assert paired_difference_text(PairedDifference([], [], []), signed, dash="") == ""


def test_a_tables_paired_text_says_baseline_in_its_own_row_and_dashes_cells_without_values():
    table = demo_table()
    assert table.paired_text("FedAvg", "alpha-0.5") == "baseline"
    assert table.paired_text("SCAFFOLD", "alpha-0.5") == "+4.00 [+1.52, +6.48] *"
    assert table.paired_text("SCAFFOLD", "alpha-0.1") == "–"  # no value yet
    assert table.paired_text("FedProx", "alpha-0.5") == "–"  # a row compared with nothing


# Markdown


def test_the_markdown_rows_follow_each_setting_with_the_paper_the_difference_and_the_baseline():
    lines = demo_table().markdown().splitlines()
    assert lines[0] == "| method | α = 0.5 | paper | Δ | vs FedAvg | α = 0.1 | paper | Δ | vs FedAvg |"
    assert lines[1] == "|" + " --- |" * 9
    assert lines[2] == ("| FedAvg | 71.00 ± 1.00 (3) | 71.20 | -0.20 | baseline | **60.50 ± 0.71** (2) | – | – "
                        "| baseline |")
    assert lines[3] == ("| SCAFFOLD | **75.00 ± 1.00** (3) | 73.00 | +2.00 | +4.00 [+1.52, +6.48] * | pending | – | – "
                        "| – |")
    assert lines[4] == ""
    assert lines[-1] == "- a note"


def test_a_plain_markdown_table_has_one_column_per_setting():
    lines = demo_table(reference=False, baseline=None, baseline_of={}, notes=[]).markdown().splitlines()
    assert lines[:4] == ["| method | α = 0.5 | α = 0.1 |", "| --- | --- | --- |",
                         "| FedAvg | 71.00 ± 1.00 (3) | **60.50 ± 0.71** (2) |",
                         "| SCAFFOLD | **75.00 ± 1.00** (3) | pending |"]


@pytest.mark.parametrize("metric, at, says", [
    ("test_accuracy", "final", "test_accuracy (%), at the final round (--metric test_accuracy --at final)"),
    ("test_accuracy", "best", "test_accuracy (%), at the best evaluation (--metric test_accuracy --at best)"),
    ("test_loss", "last:3", "test_loss (%), mean of each run's last 3 evaluations (--metric test_loss --at last:3)"),
])
def test_the_caption_says_which_value_of_which_metric_and_which_way_is_best(metric, at, says):
    caption = demo_table(metric=metric, at=at).caption()
    assert caption[0].startswith(says)
    assert ("bold: the lowest of its column" if "loss" in metric else "bold: the highest of its column") in caption[0]
    assert caption[1].startswith("vs FedAvg: the mean over seeds of each run's")


def test_a_plan_variants_table_says_first_that_its_runs_are_not_at_the_plans_settings():
    table = demo_table(plan="demo-rounds8", overrides={"federation.rounds": 8, "data.alpha": 0.1})
    caption = table.caption()
    assert caption[0] == ("Plan variant demo-rounds8: the runs have federation.rounds=8, data.alpha=0.1 (--override), "
                          "not the plan's own settings; the paper's numbers are of the plan's own settings.")
    assert caption[0] in table.markdown().splitlines()


# CSV


def test_the_csv_has_each_settings_statistics_and_the_tables_context():
    table = demo_table(plan="demo-rounds8", overrides={"federation.rounds": 8})
    rows = list(csv.DictReader(io.StringIO(table.csv_text())))
    header = next(csv.reader(io.StringIO(table.csv_text())))
    per_setting = ["mean", "std", "n", "best", "paper", "diff", *PAIRED_COLUMNS]
    assert header == ["method", *(f"alpha-0.5:{part}" for part in per_setting),
                      *(f"alpha-0.1:{part}" for part in per_setting), "metric", "at", "plan", "overrides", "baseline"]
    fedavg, scaffold = rows
    assert float(fedavg["alpha-0.5:mean"]) == pytest.approx(71.0)
    assert float(fedavg["alpha-0.1:std"]) == pytest.approx(sample_std([60.0, 61.0]))
    assert float(fedavg["alpha-0.5:diff"]) == pytest.approx(71.0 - 71.2)
    assert (fedavg["alpha-0.5:n"], fedavg["alpha-0.5:best"], fedavg["alpha-0.1:best"]) == ("3", "0", "1")
    assert fedavg["alpha-0.1:paper"] == "" and fedavg["alpha-0.1:diff"] == ""
    # The baseline's own cells have no paired difference.
    assert all(fedavg[f"alpha-0.5:{part}"] == "" for part in PAIRED_COLUMNS)
    half = T_975[2] * sample_std([4.0, 3.0, 5.0]) / math.sqrt(3)
    assert float(scaffold["alpha-0.5:paired_diff"]) == pytest.approx(4.0)
    assert float(scaffold["alpha-0.5:paired_low"]) == pytest.approx(4.0 - half, abs=1e-4)
    assert float(scaffold["alpha-0.5:paired_high"]) == pytest.approx(4.0 + half, abs=1e-4)
    assert (scaffold["alpha-0.5:paired_n"], scaffold["alpha-0.5:paired_excludes_0"]) == ("3", "1")
    assert scaffold["alpha-0.1:mean"] == "" and scaffold["alpha-0.1:n"] == "0"
    assert scaffold["alpha-0.1:paired_n"] == "0" and scaffold["alpha-0.1:unpaired_seeds"] == "0 1"
    assert [fedavg[key] for key in ("metric", "at", "plan", "overrides", "baseline")] == [
        "test_accuracy", "final", "demo-rounds8", "federation.rounds=8", "FedAvg"]


def test_csv_numbers_are_rounded_to_ten_decimals_and_intervals_withheld_with_unpaired_seeds():
    cells = {("base", "s"): Cell({0: 1 / 3, 1: 0.5, 2: 0.25, 3: 0.1}), ("new", "s"): Cell({0: 1.0, 1: 0.75, 2: 0.5})}
    pair_with_baseline(cells, {"new": "base"}, ["s"])
    table = Table(metric="test_loss", at="final", methods=["base", "new"], settings=["s"], labels={"s": "S"},
                  cells=cells, curves={}, percent=False, decimals=4, reference=False, baseline="base",
                  baseline_of={"new": "base"})
    base, new = csv.DictReader(io.StringIO(table.csv_text()))
    assert base["s:mean"] == repr(round((1 / 3 + 0.5 + 0.25 + 0.1) / 4, 10))
    # Three pairs, but seed 3 of the baseline unpaired: the mean difference alone.
    assert float(new["s:paired_diff"]) == pytest.approx(((1 - 1 / 3) + 0.25 + 0.25) / 3)
    assert [new[f"s:{part}"] for part in ("paired_low", "paired_high", "paired_n", "paired_excludes_0",
                                          "unpaired_seeds")] == ["", "", "3", "", "3"]


def test_a_ratio_of_costs_shows_its_interval_beside_the_seeds_left_unpaired():
    """A cost ratio is over the seeds whose runs both reached the target by its definition: its interval is
    shown with the others named, where a paired difference with a seed unpaired shows its mean alone."""
    ratio = paired_ratio({0: 200.0, 1: 320.0, 2: 440.0, 7: 90.0}, {0: 400.0, 1: 440.0, 2: 480.0})
    mean, detail, marked = paired_difference_parts(ratio, lambda value: f"{value:.2f}")
    low, high = ratio.interval
    assert (mean, detail, marked) == (f"{ratio.mean:.2f}", f"[{low:.2f}, {high:.2f}] (seed 7 unpaired)", False)
    difference = paired_difference({0: 2.0, 1: 3.0, 2: 4.0, 7: 1.0}, {0: 1.0, 1: 1.0, 2: 1.0})
    assert paired_difference_parts(difference, str)[1] == "(3 pairs; seed 7 unpaired)"
