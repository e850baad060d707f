"""The command line: `fl-lightning fit --config FILE [--group.field value ...]` and
`fl-lightning compare --runs [DIR, ...]`."""

from __future__ import annotations

import sys
from typing import Optional

from jsonargparse import ArgumentParser, auto_parser, set_parsing_settings

from fl_lightning.algorithms import SHORT_NAMES
from fl_lightning.compare import compare
from fl_lightning.config import ConfigError
from fl_lightning.fit import fit

COMMANDS = {"fit": fit, "compare": compare}


def build_parser() -> ArgumentParser:
    # The config dataclasses document each field in a docstring under it; show those in --help.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    # as_positional=False: a required `algorithm` would otherwise become positional, and
    # `--algorithm X` would be misread.
    return auto_parser(COMMANDS, as_positional=False)


def expand_short_names(argv: list[str]) -> list[str]:
    """`--algorithm fedavg` -> `--algorithm fl_lightning.algorithms.FedAvg`, so sweeps can name
    algorithms briefly; class paths and class names pass through unchanged."""
    expanded = list(argv)
    for i, arg in enumerate(expanded):
        if arg == "--algorithm" and i + 1 < len(expanded) and expanded[i + 1] in SHORT_NAMES:
            expanded[i + 1] = _class_path(expanded[i + 1])
        elif arg.startswith("--algorithm=") and arg.split("=", 1)[1] in SHORT_NAMES:
            expanded[i] = "--algorithm=" + _class_path(arg.split("=", 1)[1])
    return expanded


def _class_path(short_name: str) -> str:
    cls = SHORT_NAMES[short_name]
    return f"{cls.__module__}.{cls.__qualname__}"


def main(argv: Optional[list[str]] = None) -> None:
    parser = build_parser()
    config = parser.parse_args(expand_short_names(sys.argv[1:] if argv is None else argv))
    command = config.subcommand
    try:
        arguments = parser.instantiate_classes(config)[command]
        arguments.pop("config", None)
        COMMANDS[command](**arguments)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    except FloatingPointError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from err


if __name__ == "__main__":
    main()
