"""jsonargparse's parser of `fl-lightning` commands, and `parse_command_line`, the one way a command
line becomes settings. `build_parser()` parses `fit` alone: what a sweep parses its grid points with,
without the other commands (the sweep among them)."""

from __future__ import annotations

import inspect
from argparse import ArgumentError
from typing import Callable, Mapping, Optional

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, set_parsing_settings

from fl_lightning.algorithms import SHORT_NAMES
from fl_lightning.cli.arguments import (
    CONFIG_MODE,
    check_class_paths,
    check_config_files,
    expand_bare_flags,
    expand_short_names,
)
from fl_lightning.cli.messages import explain_parse_error
from fl_lightning.fit import fit
from fl_lightning.models import registered_models

FIT_ALONE = {"fit": fit}


class CommandParser(ArgumentParser):
    """A parser of the subcommands `commands`, which keeps them: rewriting a command line before it
    is parsed, and restating a parse error, read the signatures of its commands."""

    commands: dict[str, Callable]


def build_parser(commands: Mapping[str, Callable] = FIT_ALONE) -> CommandParser:
    """The parser of `commands` (name -> the function whose signature is the subcommand's schema and
    whose docstring its help), each a subcommand."""
    # The config dataclasses document each field in a docstring under it; show those in --help.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    # allow_abbrev=False: `--federation.round 5` must be refused, not read as rounds.
    # exit_on_error=False: `parse_command_line` turns every parse error into one line naming the field.
    # Subcommand parsers inherit both settings.
    parser = CommandParser(prog="fl-lightning", allow_abbrev=False, exit_on_error=False)
    parser.commands = dict(commands)
    parser.add_argument("--config", action=ActionConfigFile, help="Path to a configuration file.")
    subcommands = parser.add_subcommands(required=True)
    for name, command in commands.items():
        description = inspect.getdoc(command).split("\n\n")[0]
        subparser = ArgumentParser(description=description, epilog=_epilog(name))
        subparser.add_argument("--config", action=ActionConfigFile, help="Path to a configuration file.")
        subcommands.add_subcommand(name, subparser, help=description)
        # as_positional=False: a required `algorithm` would otherwise become positional, and
        # `--algorithm X` would be misread.
        subparser.add_function_arguments(command, as_group=False, as_positional=False, sub_configs=True)
    parser.parser_mode = CONFIG_MODE  # also sets the subcommands'
    return parser


def _epilog(command: str) -> Optional[str]:
    if command != "fit":
        return None
    return (
        f"Algorithms (--algorithm, by short name): {', '.join(sorted(SHORT_NAMES))}; also by class name or "
        "class path, and `--algorithm.help NAME` lists an algorithm's own settings. "
        f"Models (--model.name): {', '.join(registered_models())}, or any timm model name."
    )


def parse_command_line(argv: list[str], parser: CommandParser) -> Namespace:
    """The one way a command line becomes settings (for `fl-lightning` and for each grid point of a
    sweep): config files checked, algorithm short names and bare flags expanded, and any parse error
    restated as a ConfigError naming the field. Returns the parsed, not yet instantiated, namespace."""
    check_config_files(argv)
    command = next((parser.commands[arg] for arg in argv if arg in parser.commands), None)
    if command is not None:
        check_class_paths(argv, command)
    try:
        return parser.parse_args(expand_bare_flags(expand_short_names(argv), parser.commands))
    except ArgumentError as err:
        raise explain_parse_error(str(err), argv, parser.commands) from err
