"""The `fl-lightning` commands: `fit --config FILE [--group.field value ...]`, `sweep PLAN`,
`table PLAN`, `dashboard PLAN`, `publish PLAN`, `data PLAN` (or `data --config FILE ...`) and
`compare --runs [DIR, ...]`.

Every bad input ends in one line on stderr, `error: <field>: expected ..., got ...`, and exit
status 2, before any data is loaded or training starts (see `fl_lightning.cli.messages`). A run
that cannot go on for a cause outside its settings ends in one `error:` line too, naming the cause
and the checkpoint the same command resumes from: exit status 74 for a file it cannot write (a full
disk, a read-only folder), 75 for another rank that is gone (`fl_lightning.errors.RunInterrupted`).
"""

from __future__ import annotations

import functools
import itertools
import sys
from typing import Optional

from fl_lightning.cli.messages import one_line_warnings
from fl_lightning.cli.parser import CommandParser, build_parser, parse_command_line
from fl_lightning.cluster import RequeueFailed
from fl_lightning.errors import ConfigError, RunInterrupted
from fl_lightning.experiments.results.compare import compare
from fl_lightning.experiments.results.dashboard import dashboard
from fl_lightning.experiments.results.publish import publish
from fl_lightning.experiments.results.table import table
from fl_lightning.experiments.sweeps.data_check import data, data_of_fit_line, fit_line_of
from fl_lightning.experiments.sweeps.sweep import sweep
from fl_lightning.fit import fit

COMMANDS = {"fit": fit, "compare": compare, "table": table, "sweep": sweep, "dashboard": dashboard, "data": data,
            "publish": publish}


@functools.cache
def command_parser() -> CommandParser:
    """The parser of every command, built once in a process: building it takes longer than a small
    run trains, and `main` called again in one process (a notebook, a script of runs) parses each
    command line with it as a parser of its own would."""
    return build_parser(COMMANDS)


# Subcommands whose first argument may be the plan itself: `fl-lightning sweep PLAN`.
PLAN_COMMANDS = ("sweep", "table", "dashboard", "data", "publish")


def main(argv: Optional[list[str]] = None) -> None:
    with one_line_warnings():
        _run(list(sys.argv[1:] if argv is None else argv))


def _run(argv: list[str]) -> None:
    data_fit_line = fit_line_of(argv)  # `data --config FILE ...`: a fit command line, parsed as fit parses it
    if argv and argv[0] in PLAN_COMMANDS:
        argv = _plan_command_line(argv)
    elif argv and argv[0] == "compare":
        argv = _runs_command_line(argv)
    try:
        if (model := _model_asked_about(argv)) is not None:
            from fl_lightning.models.registry import model_help

            print(model_help(model))
            return
        if data_fit_line is not None:
            data_of_fit_line(data_fit_line)
            return
        parser = command_parser()
        config = parse_command_line(argv, parser)
        command = config.subcommand
        arguments = _instantiated(parser, config)[command]
        arguments.pop("config", None)
        COMMANDS[command](**arguments)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    except (FloatingPointError, RequeueFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from err
    except RunInterrupted as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(err.exit_status) from err


def _instantiated(parser, config):
    """The settings' classes built. A class under an Optional setting (the constraint) that refuses its
    arguments reaches us as jsonargparse's ValueError about a Union, caused by the refusal: raise the
    refusal itself, which names the field."""
    try:
        return parser.instantiate(config)
    except ValueError as err:
        cause: Optional[BaseException] = err
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None


def _plan_command_line(argv: list[str]) -> list[str]:
    """`table A.yaml B.yaml --override K=V --override L=W` -> `table --plan+ A.yaml --plan+ B.yaml
    --override+ K=V --override+ L=W`: the plans first (each a `--plan`), then every value of an option
    given one at a time appended to its list (jsonargparse's `--name+`), as a repeated option would
    otherwise keep its last value only. A single plan stays `--plan PLAN`."""
    plans = list(itertools.takewhile(lambda arg: not arg.startswith("-"), argv[1:]))
    arguments = [option for plan in plans for option in ("--plan", plan)] + argv[1 + len(plans):]
    repeated_plans = sum(arg == "--plan" or arg.startswith("--plan=") for arg in arguments) > 1
    rewritten = [argv[0]]
    for position, arg in enumerate(arguments):
        option, equals, value = arg.partition("=")
        if not equals and position + 1 < len(arguments):
            value = arguments[position + 1]
        if (option == "--override" and not value.startswith("[")) or (option == "--plan" and repeated_plans):
            arg = f"{option}+{equals}{value if equals else ''}"
        rewritten.append(arg)
    return rewritten


def _runs_command_line(argv: list[str]) -> list[str]:
    """`compare --runs a b --runs c` -> `compare --runs+ a --runs+ b --runs+ c`: run folders given one
    after another (as a shell expands `--runs runs/x/*`) or with --runs repeated are one list, as a
    repeated option would otherwise keep its last value only. A single --runs value (a folder, a
    pattern, a [list]) stays as it is."""
    runs, others, position = [], [], 1
    while position < len(argv):
        option, equals, value = argv[position].partition("=")
        position += 1
        if option != "--runs":
            others.append(argv[position - 1])
            continue
        runs += [value] if equals else []
        while position < len(argv) and not argv[position].startswith("-"):
            runs.append(argv[position])
            position += 1
    if len(runs) <= 1:
        return argv
    return [argv[0], *[arg for run in runs for arg in ("--runs+", run)], *others]


def _model_asked_about(argv: list[str]) -> Optional[str]:
    """NAME of `--model.help NAME` (or `--model.help=NAME`), which jsonargparse has no action for:
    `model` is a group of settings, not a class."""
    for position, arg in enumerate(argv):
        if arg == "--model.help":
            if position + 1 == len(argv):
                raise ConfigError("model.help", "a model name after --model.help", "nothing")
            return argv[position + 1]
        if arg.startswith("--model.help="):
            return arg.split("=", 1)[1]
    return None
