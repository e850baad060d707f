"""jsonargparse's parser of `fl-lightning` commands, and `parse_command_line`, the one way a command
line becomes settings. `build_parser()` parses `fit` alone: what a sweep parses its grid points with,
without the other commands (the sweep among them), through `GridPointParser`."""

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
from fl_lightning.configurable import resolve_dotted_path
from fl_lightning.fit import fit, unused_settings
from fl_lightning.models import registered_models

FIT_ALONE = {"fit": fit}


class CommandParser(ArgumentParser):
    """A parser of the subcommands `commands`, which keeps them: rewriting a command line before it
    is parsed, and restating a parse error, read the signatures of its commands."""

    commands: dict[str, Callable]
    subcommand_parsers: dict[str, ArgumentParser]


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
    parser.subcommand_parsers = {}
    parser.add_argument("--config", action=ActionConfigFile, help="Path to a configuration file.")
    subcommands = parser.add_subcommands(required=True)
    for name, command in commands.items():
        description = inspect.getdoc(command).split("\n\n")[0]
        subparser = (FitParser if command is fit else ArgumentParser)(description=description, epilog=_epilog(name))
        subparser.add_argument("--config", action=ActionConfigFile, help="Path to a configuration file.")
        subcommands.add_subcommand(name, subparser, help=description)
        parser.subcommand_parsers[name] = subparser
        # as_positional=False: a required `algorithm` would otherwise become positional, and
        # `--algorithm X` would be misread.
        subparser.add_function_arguments(command, as_group=False, as_positional=False, sub_configs=True)
    parser.parser_mode = CONFIG_MODE  # also sets the subcommands'
    return parser


class FitParser(ArgumentParser):
    """`fit`'s parser, whose dump (`--print_config`) marks each group of settings that the run never
    reads (fit.unused_settings: CTP-FL's client optimizer), which it would otherwise show as if used;
    a comment, so that the printed config still reads back as it is."""

    def dump(self, cfg: Namespace, *args, **kwargs) -> str:
        text = super().dump(cfg, *args, **kwargs)
        algorithm = cfg.get("algorithm")
        class_path = getattr(algorithm, "class_path", None)
        if not isinstance(class_path, str):
            return text
        for group, why in unused_settings(resolve_dotted_path(class_path)).items():
            text = text.replace(f"\n{group}:", f"\n# {group}: not read by this run ({why})\n{group}:", 1)
        return text


def _epilog(command: str) -> Optional[str]:
    if command != "fit":
        return None
    return (
        f"Algorithms (--algorithm, by short name): {', '.join(sorted(SHORT_NAMES))}; also by class name or "
        "class path, and `--algorithm.help NAME` lists an algorithm's own settings. "
        f"Models (--model.name): {', '.join(registered_models())}, or any timm model name."
    )


# Options that print instead of parsing.
_PRINTING = ("--help", "-h", "--print_config")


def parse_command_line(argv: list[str], parser: CommandParser) -> Namespace:
    """The one way a command line becomes settings (for `fl-lightning` and for each grid point of a
    sweep): config files checked, algorithm short names and bare flags expanded, and any parse error
    restated as a ConfigError naming the field. Returns the parsed, not yet instantiated, namespace.

    A line that starts with its command and neither asks for help nor prints its config is parsed by
    that command's parser alone: the settings the whole parser gives, which, after that parser has
    parsed the line, computes the command's defaults and checks its settings once more (a fit line
    takes it about 40% longer: benchmarks/resolve.py). A line that this parse refuses is parsed by
    the whole parser, for the error it gives."""
    check_config_files(argv)
    command = next((parser.commands[arg] for arg in argv if arg in parser.commands), None)
    if command is not None:
        check_class_paths(argv, command)
    expanded = expand_bare_flags(expand_short_names(argv), parser.commands)
    if expanded and expanded[0] in parser.commands and not any(arg.partition("=")[0] in _PRINTING for arg in expanded):
        try:
            settings = parser.subcommand_parsers[expanded[0]].parse_args(expanded[1:])
            return Namespace(config=None, subcommand=expanded[0], **{expanded[0]: settings})
        except ArgumentError:
            pass
    try:
        return parser.parse_args(expanded)
    except ArgumentError as err:
        raise explain_parse_error(str(err), argv, parser.commands) from err


# The options whose values tell apart the command lines of one setting and method of a sweep: the
# seed, and the run folder and W&B run name made with it (fl_lightning.experiments.plans.plan.GridPoint).
PER_RUN_OPTIONS = ("--seed", "--out_dir", "--logger.name")
# Options that could set a per-run value again after the command line gave it.
_SETTING_PER_RUN_VALUES = ("--config", "--logger")


class GridPointParser:
    """`parse_command_line` of many `fit` command lines, as a sweep's grid points: what it returns and
    raises for each. Lines that differ only in the values of PER_RUN_OPTIONS (a setting and method's
    seeds) are one group. The first line of a group is parsed in full; each other one is parsed as the
    first one's settings with its own values of those options, by the same `fit` parser (the same types
    and the same check of the whole settings), without the defaults and class defaults that a full parse
    computes again and that are most of its cost. A line that fails that way is parsed in full, to
    raise what it raises on its own."""

    def __init__(self, parser: CommandParser):
        self.parser = parser
        self._first_of_group: dict[tuple, Namespace] = {}
        self.full_parses = 0
        """How many lines were parsed in full: the first of each group, and those of no group."""

    def parse(self, argv: list[str]) -> Namespace:
        group = _per_run_group(argv)
        first = None if group is None else self._first_of_group.get(group)
        if first is None:
            self.full_parses += 1
            settings = parse_command_line(argv, self.parser)
            if group is not None:
                self._first_of_group[group] = settings.clone()
            return settings
        # Same config files and class paths as the first line: check_config_files and check_class_paths
        # accept this one as they accepted that one. Neither short names nor bare flags are among the
        # per-run options and their values, which are parsed as they are given.
        per_run = [token for option in PER_RUN_OPTIONS for token in (option, argv[argv.index(option) + 1])]
        try:
            fit_settings = self.parser.subcommand_parsers["fit"].parse_args(
                per_run, namespace=first.fit.clone(), defaults=False)
        except ArgumentError:
            self.full_parses += 1
            return parse_command_line(argv, self.parser)
        settings = first.clone()
        settings.fit = fit_settings
        return settings


def _per_run_group(argv: list[str]) -> Optional[tuple]:
    """The command line with the values of PER_RUN_OPTIONS left out, where each of those options is given
    once, with a value, and nothing after the first of them can set one of their values again (no
    config file, no whole `logger` group); None for any other line (parsed in full), and for one that
    asks for help or its config printed."""
    if not argv or argv[0] != "fit" or any(arg.partition("=")[0] in _PRINTING for arg in argv):
        return None
    positions = []
    for option in PER_RUN_OPTIONS:
        if argv.count(option) != 1 or any(arg.startswith(f"{option}=") for arg in argv):
            return None
        position = argv.index(option)
        if position + 1 == len(argv) or argv[position + 1].startswith("-"):
            return None
        positions.append(position)
    after_first = argv[min(positions):]
    if any(arg == option or arg.startswith(f"{option}=") for arg in after_first for option in _SETTING_PER_RUN_VALUES):
        return None
    values = {position + 1 for position in positions}
    return tuple(None if position in values else arg for position, arg in enumerate(argv))
