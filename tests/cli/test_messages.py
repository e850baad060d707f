"""Parse errors restated (fl_lightning.cli.messages): jsonargparse's and argparse's messages, as they
word them, turned into one `<field>: expected ..., got ...` for a small command schema defined
here, and the plain words for what a type annotation accepts."""

import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

import processes
import pytest
import quick_runs

from fl_lightning.algorithms import SHORT_NAMES, Algorithm
from fl_lightning.checkpoint import checkpoint_dir
from fl_lightning.cli.messages import (
    UsageError,
    class_in,
    describe_type,
    explain_parse_error,
    one_line_warnings,
    setting_names,
)
from fl_lightning.config import FinitePositiveFloat, NonNegativeInt, PositiveInt
from fl_lightning.errors import ConfigError, RunWarning


@dataclass
class Federation:
    rounds: PositiveInt = 3
    clients_per_round: PositiveInt = 2
    weighting: Literal["num_samples", "uniform"] = "num_samples"


class Shape:
    pass


class Circle(Shape):
    pass


class Square(Shape):
    pass


class _Sketch(Shape):
    """A private helper class: not one to offer."""


def demo(required: float, algorithm: Optional[Algorithm] = None, federation: Federation = Federation(),
         seed: int = 0, shapes: Optional[list[Shape]] = None, out_dir: Optional[Path] = None):
    """A command whose signature is its schema."""


def other(runs: list[str]):
    """A second command."""


COMMANDS = {"demo": demo, "other": other}
ALGORITHMS = (f"an algorithm: one of {', '.join(sorted(SHORT_NAMES))}, or an Algorithm subclass by class name or "
              "class path")


def explained(message: str, argv: list[str]) -> str:
    error = explain_parse_error(message, argv, COMMANDS)
    assert isinstance(error, ConfigError)  # what the command line prints as one `error:` line
    return str(error)


# The command


def test_a_line_without_a_command_is_told_the_commands():
    assert explained("the following arguments are required: subcommand", []) == (
        "command: expected one of demo, other, got nothing")
    assert explained("invalid choice: 'dmeo'", ["dmeo", "--seed", "1"]) == (
        "command: expected one of demo, other, got 'dmeo'")


# Unknown keys


@pytest.mark.parametrize("message, argv, line", [
    ("unrecognized arguments: --federation.roundz 4", ["demo", "--federation.roundz", "4"],
     "federation.roundz: expected a known setting (did you mean federation.rounds?), "
     "got the unknown key '--federation.roundz'"),
    ("unrecognized arguments: --federation.roundz=4", ["demo", "--federation.roundz=4"],
     "federation.roundz: expected a known setting (did you mean federation.rounds?), "
     "got the unknown key '--federation.roundz'"),
    ("unrecognized arguments: --sed 1", ["demo", "--sed", "1"],
     "sed: expected a known setting (did you mean seed?), got the unknown key '--sed'"),
    ("unrecognized arguments: --zzzzzz 1", ["demo", "--zzzzzz", "1"],
     "zzzzzz: expected a known setting (see `fl-lightning demo --help`), got the unknown key '--zzzzzz'"),
])
def test_an_unknown_flag_is_told_the_closest_settings(message, argv, line):
    assert explained(message, argv) == line


def test_an_unknown_key_of_a_group_is_matched_among_that_groups_settings_only():
    # `seed` is not offered for a key of federation, however close.
    line = explained("unrecognized arguments: --federation.sed 1", ["demo", "--federation.sed", "1"])
    assert line.startswith("federation.sed: expected a known setting (did you mean federation.")
    assert "did you mean seed" not in line


def test_an_unknown_key_in_a_config_file_is_named_as_the_configs():
    assert explained("Subcommand 'demo' does not accept option 'federation.roundz'", ["demo", "--config", "c.yaml"]) \
        == ("federation.roundz: expected a known setting (did you mean federation.rounds?), "
            "got the unknown key 'federation.roundz' in the config")


def test_a_positional_argument_is_refused_as_such():
    assert explained("unrecognized arguments: extra", ["demo", "extra"]) == (
        "arguments: expected --group.field value pairs (no positional arguments), got 'extra'")


def class_path_message(class_path: str, option: str) -> str:
    """jsonargparse's message for an option the class given to `algorithm` does not take."""
    return (f'Parser key "algorithm":\n  Does not validate against any of the Union subtypes\n  Errors:\n'
            f"    - Problem with given class_path '{class_path}':\n        Option '{option}' is not accepted\n"
            f"    - Expected a <class 'NoneType'>\n  Given value: NestedArg(key='{option}', val='0.1')")


def test_an_unknown_setting_of_a_class_is_matched_among_that_classes_arguments():
    message = class_path_message("fl_lightning.algorithms.fedprox.FedProx", "mux")
    assert explained(message, ["demo", "--algorithm", "fedprox", "--algorithm.mux", "0.1"]) == (
        "algorithm.mux: expected a known setting (did you mean algorithm.mu?), got the unknown key '--algorithm.mux'")
    # Nothing close: the class's settings are listed.
    key = "algorithm.weight_of_the_proximal_term"
    message = class_path_message("fl_lightning.algorithms.fedprox.FedProx", key.partition(".")[2])
    assert explained(message, ["demo", "--algorithm", "fedprox", f"--{key}", "0.1"]) == (
        f"{key}: expected a known setting (one of algorithm.mu), got the unknown key '--{key}'")


def test_a_setting_of_a_class_that_takes_none_says_so():
    message = class_path_message("fl_lightning.algorithms.FedAvg", "mu")
    assert explained(message, ["demo", "--algorithm.mu", "0.1", "--algorithm", "fedavg"]) == (
        "algorithm.mu: expected no setting under algorithm (FedAvg takes none; give --algorithm before the settings "
        "of the class it names), got the unknown key '--algorithm.mu'")


# Bad values


def test_a_bad_value_is_told_what_its_type_accepts_and_shown_as_given():
    message = 'Parser key "federation.rounds":\n  Not of type PositiveInt: 0 does not conform to restriction v>0'
    assert explained(message, ["demo", "--federation.rounds", "0"]) == (
        "federation.rounds: expected an integer > 0, got '0'")
    assert explained(message, ["demo", "--federation.rounds=0"]) == (
        "federation.rounds: expected an integer > 0, got '0'")


def test_a_value_from_a_config_file_is_read_off_the_message():
    message = 'Parser key "seed":\n  Expected a <class \'int\'>. Got value: x'
    assert explained(message, ["demo", "--config", "c.yaml"]) == "seed: expected an integer, got 'x'"
    message = 'Parser key "federation.weighting":\n  Expected a typing.Literal[...]. Got value: mean'
    assert explained(message, ["demo", "--config", "c.yaml"]) == (
        "federation.weighting: expected one of num_samples, uniform, got 'mean'")


def test_a_value_nowhere_to_be_found_is_an_invalid_value():
    assert explained('Parser key "seed":\n  something else', ["demo"]) == (
        "seed: expected an integer, got an invalid value")


def test_a_key_a_nested_message_repeats_is_named_once():
    message = 'Parser key "federation":\n  - Parser key "federation":\n    - Parser key "rounds":\n  Given value: -1'
    assert explained(message, ["demo"]) == "federation.rounds: expected an integer > 0, got '-1'"


def test_a_config_that_cannot_be_loaded_is_told_to_be_a_yaml_file():
    message = "Parser key \"config\":\n  Unable to load config 'missing.yaml'"
    assert explained(message, ["demo", "--config", "missing.yaml"]) == (
        "config: expected an existing YAML file of settings, got 'missing.yaml'")


def test_a_flag_without_its_value_is_told_to_give_one():
    assert explained("argument --seed: expected one argument", ["demo", "--seed"]) == (
        "seed: expected a value after --seed, got nothing")


def test_a_required_setting_left_out_is_named_without_its_command():
    assert explained("the following arguments are required: demo.required", ["demo"]) == (
        "required: expected a finite number, got nothing (it is required)")
    assert explained('Key "demo.required" is required but not included in config object or its value is None',
                     ["demo"]) == "required: expected a finite number, got nothing (it is required)"


def test_help_for_a_class_is_told_which_classes_there_are():
    assert explained("argument --algorithm.help: invalid choice: 'fedpro'", ["demo", "--algorithm.help", "fedpro"]) \
        == f"algorithm.help: expected {ALGORITHMS} or null, got 'fedpro'"


def test_print_config_is_told_its_flags():
    assert explained('Invalid option "bad" for --print_config', ["demo", "--print_config=bad"]) == (
        "print_config: expected skip_default, skip_unset, both or nothing, got 'bad'")


def test_a_message_of_no_known_form_is_restated_by_its_first_line():
    assert explained("something unforeseen\nand its details", ["other"]) == (
        "arguments: expected settings accepted by `fl-lightning other --help`, got something unforeseen")


def test_the_error_names_its_field():
    error = explain_parse_error("argument --seed: expected one argument", ["demo", "--seed"], COMMANDS)
    assert isinstance(error, UsageError) and error.field_name == "seed"


# The words for a type


@pytest.mark.parametrize("annotation, words", [
    (PositiveInt, "an integer > 0"),
    (NonNegativeInt, "an integer >= 0"),
    (FinitePositiveFloat, "a finite number > 0"),
    (Literal["sgd", "adam"], "one of sgd, adam"),
    (Optional[int], "an integer or null"),
    (Union[PositiveInt, Literal["auto"]], "an integer > 0 or one of auto"),
    (list[str], "a list of strings (e.g. [a, b])"),
    (tuple[float, ...], "a list of numbers (e.g. [a, b])"),
    (list, "a list (e.g. [a, b])"),
    (dict[str, int], "a mapping (e.g. {key: value})"),
    (bool, "true or false"),
    (int, "an integer"),
    (float, "a finite number"),
    (str, "a string"),
    (Path, "a path"),
    (list[Shape], "a list of Shape subclasses (e.g. [{class_path: module.Class}])"),
    (Shape, "a Shape: one of Circle, Square (class name or class path)"),
    (Algorithm, ALGORITHMS),
])
def test_a_type_is_described_in_plain_words(annotation, words):
    assert describe_type(annotation) == words


def test_a_group_of_settings_is_described_by_its_fields():
    assert describe_type(Federation, "federation") == (
        "a mapping of federation settings (rounds, clients_per_round, weighting) or a YAML file of them")


@pytest.mark.parametrize("annotation, found", [
    (Shape, Shape), (Optional[Shape], Shape), (Optional[list[Shape]], Shape), (Optional[Algorithm], Algorithm),
    (int, None), (Optional[str], None), (Path, None), (Federation, None), (dict[str, float], None),
])
def test_the_class_an_annotation_takes_by_class_path(annotation, found):
    assert class_in(annotation) is found


def test_the_settings_of_a_command_are_its_parameters_and_its_groups_fields():
    assert setting_names(demo) == ["config", "print_config", "help", "required", "algorithm", "federation",
                                   "federation.rounds", "federation.clients_per_round", "federation.weighting",
                                   "seed", "shapes", "out_dir"]


def test_fl_lightnings_own_warnings_are_one_line_and_a_librarys_as_python_shows_them():
    python_format = warnings.formatwarning
    with one_line_warnings():
        assert warnings.formatwarning("a damaged checkpoint", RunWarning, "fit.py", 3) == (
            "warning: a damaged checkpoint\n")
        library = warnings.formatwarning("a library's", UserWarning, "library.py", 7, "warn()")
    assert library == python_format("a library's", UserWarning, "library.py", 7, "warn()")
    assert "library.py:7: UserWarning: a library's" in library
    assert warnings.formatwarning is python_format


@pytest.mark.slow
def test_a_warning_on_resuming_a_run_is_one_line(run_copy):
    """`fit` passing over a damaged last.ckpt, in a real process: the one line the docs show, without
    Python's file, line and echoed code."""
    folder = checkpoint_dir(run_copy)
    (folder / "last.ckpt").unlink()
    (folder / "last.ckpt").write_bytes(b"garbage")
    completed = processes.run([sys.executable, "-m", "fl_lightning", *quick_runs.BASE, "--federation.rounds",
                               str(quick_runs.ROUNDS), "--resume", "auto", "--out_dir", str(run_copy)], timeout=120)
    assert completed.returncode == 0, completed.stderr
    (warning,) = [line for line in completed.stderr.splitlines() if "last.ckpt" in line]
    assert re.fullmatch(rf"warning: checkpoint {re.escape(str(folder / 'last.ckpt'))} is unreadable \(.*\); "
                        rf"rewritten from {re.escape(str(folder))}/round_0+{quick_runs.ROUNDS}\.ckpt "
                        rf"\(round {quick_runs.ROUNDS}\)", warning)
    assert "UserWarning" not in completed.stderr and "warnings.warn" not in completed.stderr
