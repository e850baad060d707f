"""The papers' numbers beside a table (fl_lightning.experiments.results.reference): the reference CSV read
(`read_reference`), what it refuses, and its numbers matched to a table's rows and columns
(`paper_numbers`), on CSV files written here by hand."""

import re
from pathlib import Path

import pytest

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.results.reference import paper_numbers, read_reference

SETTINGS = ["dataset-cifar10_alpha-0.5", "dataset-cifar10_alpha-0.1"]
LABELS = {"dataset-cifar10_alpha-0.5": "α = 0.5", "dataset-cifar10_alpha-0.1": "α = 0.1"}


def write(tmp_path: Path, text: str, name: str = "paper.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# Reading the CSV


def test_each_method_gets_its_number_per_column_and_an_empty_field_is_not_reported(tmp_path):
    path = write(tmp_path, "method,alpha-0.5,alpha-0.1\nFedAvg,71.20,65.02\nFedAvg + CONST,74.51,\n")
    assert read_reference(path) == {"FedAvg": {"alpha-0.5": 71.2, "alpha-0.1": 65.02},
                                    "FedAvg + CONST": {"alpha-0.5": 74.51, "alpha-0.1": None}}


def test_a_spread_after_the_number_is_ignored(tmp_path):
    path = write(tmp_path, "method,a,b\nSCAFFOLD,72.3 ± 0.4,  68.0±1.2 \n")
    assert read_reference(path) == {"SCAFFOLD": {"a": 72.3, "b": 68.0}}


def test_spaces_around_the_header_and_the_method_are_ignored_and_blank_lines_skipped(tmp_path):
    path = write(tmp_path, " method , a \n\n  FedProx  , 70\n,\n")
    assert read_reference(path) == {"FedProx": {"a": 70.0}}


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    # As a spreadsheet saves "CSV UTF-8".
    path = tmp_path / "paper.csv"
    path.write_bytes("method,a\r\nFedAvg,70.5\r\n".encode("utf-8-sig"))
    assert read_reference(path) == {"FedAvg": {"a": 70.5}}


def test_a_short_row_leaves_its_last_columns_out(tmp_path):
    path = write(tmp_path, "method,a,b,c\nFedAvg,1.5\n")
    assert read_reference(path) == {"FedAvg": {"a": 1.5}}


def test_a_field_that_is_not_a_number_is_refused_naming_where_it_is(tmp_path):
    path = write(tmp_path, "method,a,b\nFedAvg,70,71\nMOON,n/a,72\n")
    with pytest.raises(ConfigError) as refused:
        read_reference(path)
    assert refused.value.field_name == "reference"
    assert str(refused.value) == (f"reference: expected numbers in percent or empty fields, got \"'n/a' in {path}, "
                                  "line 3, column a\"")


@pytest.mark.parametrize("text", ["setting,a\nFedAvg,70\n", "", "\n"])
def test_a_csv_whose_first_column_is_not_method_is_refused(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape("reference: expected a CSV whose first column is `method`")):
        read_reference(path)


def test_a_file_that_is_not_text_is_refused(tmp_path):
    path = tmp_path / "paper.csv"
    path.write_bytes(b"method,a\nFedAvg,\xff\xfe70\n")
    with pytest.raises(ConfigError, match=re.escape("expected a readable CSV file (method, then one column per "
                                                    "setting)")):
        read_reference(path)


def test_a_missing_file_is_refused_as_a_readable_csv(tmp_path):
    with pytest.raises(ConfigError, match="expected a readable CSV file"):
        read_reference(tmp_path / "absent.csv")


# Matching a table's cells


def test_every_cell_of_the_table_gets_the_papers_number_or_none(tmp_path):
    path = write(tmp_path, "method,dataset-cifar10_alpha-0.5,dataset-cifar10_alpha-0.1\n"
                           "FedAvg,71.2,65.0\nSCAFFOLD,74.0,\n")
    numbers = paper_numbers(path, ["FedAvg", "SCAFFOLD", "MOON"], SETTINGS, LABELS)
    assert numbers == {("FedAvg", SETTINGS[0]): 71.2, ("FedAvg", SETTINGS[1]): 65.0,
                       ("SCAFFOLD", SETTINGS[0]): 74.0, ("SCAFFOLD", SETTINGS[1]): None,
                       ("MOON", SETTINGS[0]): None, ("MOON", SETTINGS[1]): None}


def test_a_method_is_matched_by_its_folder_form_and_a_setting_by_its_label(tmp_path):
    path = write(tmp_path, "method,α = 0.5,dataset-cifar10_alpha-0.1\nfedavg+const,74.5,69.0\n")
    numbers = paper_numbers(path, ["FedAvg + CONST"], SETTINGS, LABELS)
    assert numbers == {("FedAvg + CONST", SETTINGS[0]): 74.5, ("FedAvg + CONST", SETTINGS[1]): 69.0}


def test_an_exact_method_name_comes_before_another_with_the_same_folder_form(tmp_path):
    # The folder form alone would take the last of the two rows.
    path = write(tmp_path, "method,a\nFedAvg,2.0\nfedavg,1.0\n")
    assert paper_numbers(path, ["FedAvg"], ["a"], {"a": "A"}) == {("FedAvg", "a"): 2.0}


def test_the_settings_name_comes_before_its_label(tmp_path):
    path = write(tmp_path, "method,A,a\nFedAvg,1.0,2.0\n")
    assert paper_numbers(path, ["FedAvg"], ["a"], {"a": "A"}) == {("FedAvg", "a"): 2.0}


def test_methods_and_columns_the_table_lacks_are_ignored(tmp_path):
    path = write(tmp_path, "method,a,elsewhere\nFedAvg,1.0,3.0\nFedNova,4.0,5.0\n")
    assert paper_numbers(path, ["FedAvg"], ["a"], {"a": "A"}) == {("FedAvg", "a"): 1.0}


def test_a_reference_file_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(ConfigError) as refused:
        paper_numbers(tmp_path / "paper.csv", ["FedAvg"], ["a"], {"a": "A"})
    assert str(refused.value) == (f"reference: expected an existing CSV file of the papers' numbers, "
                                  f"got '{tmp_path / 'paper.csv'}'")
