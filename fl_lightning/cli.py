"""The command line: `fl-lightning fit --config FILE [--group.field value ...]` and
`fl-lightning compare --runs [DIR, ...]`.

Every bad input ends in one line on stderr, `error: <field>: expected ..., got ...`, and exit
status 2, before any data is loaded or training starts: jsonargparse's parse errors are rewritten
into that form here, with the expected value taken from the field's type and, for an unknown key,
the closest valid names.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
import sys
import typing
from argparse import ArgumentError
from pathlib import Path
from typing import Literal, Optional, Union

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, get_loader, set_loader, set_parsing_settings

from fl_lightning.algorithms import SHORT_NAMES, Algorithm
from fl_lightning.cluster import RequeueFailed
from fl_lightning.compare import compare
from fl_lightning.config import TYPE_DESCRIPTIONS
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.sweep import sweep
from fl_lightning.experiments.table import table
from fl_lightning.fit import fit
from fl_lightning.models import registered_models

COMMANDS = {"fit": fit, "compare": compare, "table": table, "sweep": sweep}

# Options whose value may be an algorithm's short name.
ALGORITHM_OPTIONS = ("--algorithm", "--algorithm.help", "--algorithm.class_path")


def build_parser() -> ArgumentParser:
    # The config dataclasses document each field in a docstring under it; show those in --help.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    # allow_abbrev=False: `--federation.round 5` must be refused, not read as rounds.
    # exit_on_error=False: `main` turns every parse error into one line naming the field.
    # Subcommand parsers inherit both settings.
    parser = ArgumentParser(prog="fl-lightning", allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="Path to a configuration file.")
    subcommands = parser.add_subcommands(required=True)
    for name, command in COMMANDS.items():
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


def expand_short_names(argv: list[str]) -> list[str]:
    """`--algorithm fedprox` -> `--algorithm '{class_path: fl_lightning.algorithms.fedprox.FedProx}'`
    (also for a class name or class path): a mapping, which `explicit_algorithms` fills with the
    algorithm's defaults, so that an algorithm chosen on the command line after a config that chose
    another never inherits its hyper-parameters (FedCM's alpha as FedDyn's). `--algorithm.help NAME`
    and `--algorithm.class_path NAME` get the class path; other values pass through unchanged."""
    expanded = list(argv)
    for i, arg in enumerate(expanded):
        option, equals, value = arg.partition("=")
        if option not in ALGORITHM_OPTIONS:
            continue
        position = i if equals else i + 1
        if not equals:
            if position >= len(expanded):
                continue
            value = expanded[position]
        cls = _algorithm_class(value) if option == "--algorithm" else None
        if cls is not None:
            value = f"{{class_path: {cls.__module__}.{cls.__qualname__}}}"
        elif value in SHORT_NAMES:
            value = _class_path(value)
        else:
            continue
        expanded[position] = f"{option}={value}" if equals else value
    return expanded


def expand_bare_flags(argv: list[str]) -> list[str]:
    """`--dry_run` -> `--dry_run=true` for an on/off setting of the command given with no value (the
    last argument, or one followed by another option), as flags read in any command line tool;
    `--dry_run false` is unchanged."""
    command = next((arg for arg in argv if arg in COMMANDS), None)
    if command is None:
        return argv
    flags = _bool_options(COMMANDS[command])
    return [f"{arg}=true" if arg in flags and (i + 1 == len(argv) or argv[i + 1].startswith("--")) else arg
            for i, arg in enumerate(argv)]


def _bool_options(command) -> set[str]:
    """The options of `command` that take true or false: its own bool parameters and the bool fields of
    its settings groups (`--data.augment`)."""
    options = set()
    for name, hint in typing.get_type_hints(command).items():
        if dataclasses.is_dataclass(hint):
            options |= {f"--{name}.{field}" for field, field_hint in typing.get_type_hints(hint).items()
                        if _is_bool(field_hint)}
        elif _is_bool(hint):
            options.add(f"--{name}")
    return options


def _is_bool(hint) -> bool:
    return hint is bool or hint == Optional[bool]


def _class_path(short_name: str) -> str:
    cls = SHORT_NAMES[short_name]
    return f"{cls.__module__}.{cls.__qualname__}"


# Config files (and inline YAML values) are read with jsonargparse's YAML loader followed by
# `explicit_algorithms`.
CONFIG_MODE = "fl_yaml"


def load_config_text(text: str):
    return explicit_algorithms(get_loader("yaml")(text))


def explicit_algorithms(value):
    """In a loaded config, `algorithm: fedprox` or `algorithm: {class_path: fedprox, init_args: {mu: 0.1}}`
    (short name, class name or class path) -> the class path with every init argument: its
    defaults, then those given. So a YAML file names algorithms as the command line does, and an
    algorithm named in a later --config file starts from its own defaults: jsonargparse would
    otherwise keep the earlier algorithm's init_args that the new class also accepts (FedProx's mu
    as MOON's mu, FedCM's alpha as FedDyn's). A mapping with init_args only (no class) still
    changes the algorithm already chosen."""
    if not isinstance(value, dict):
        return value
    if "class_path" in value:  # an algorithm given inline or as a file of its own
        return _explicit_algorithm(value)
    for settings in (value, value.get("fit")):
        if isinstance(settings, dict) and "algorithm" in settings:
            settings["algorithm"] = _explicit_algorithm(settings["algorithm"])
    return value


def _explicit_algorithm(spec):
    named = spec.get("class_path") if isinstance(spec, dict) else spec
    cls = _algorithm_class(named)
    if cls is None:
        return spec  # not an algorithm, or not one we can resolve: jsonargparse reports it
    given = spec.get("init_args", {}) if isinstance(spec, dict) else {}
    if not isinstance(given, dict):
        return spec
    defaults = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
                if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and isinstance(p.default, (type(None), bool, int, float, str))}
    extra = {key: item for key, item in spec.items() if key not in ("class_path", "init_args")} \
        if isinstance(spec, dict) else {}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": {**defaults, **given}, **extra}


def _algorithm_class(name) -> Optional[type]:
    if not isinstance(name, str):
        return None
    if name in SHORT_NAMES:
        return SHORT_NAMES[name]
    same_name = [cls for cls in _subclasses(Algorithm) if cls.__name__ == name]
    cls = same_name[0] if len(same_name) == 1 else _import_class(name)
    return cls if inspect.isclass(cls) and issubclass(cls, Algorithm) else None


set_loader(CONFIG_MODE, load_config_text, exceptions=(yaml.YAMLError,))


# Subcommands whose first argument may be the plan itself: `fl-lightning sweep PLAN`.
PLAN_COMMANDS = ("sweep", "table")


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and argv[0] in PLAN_COMMANDS and not argv[1].startswith("-"):
        argv = [argv[0], "--plan", *argv[1:]]
    try:
        if (model := _model_asked_about(argv)) is not None:
            from fl_lightning.models.registry import model_help

            print(model_help(model))
            return
        parser = build_parser()
        config = parse_command_line(argv, parser)
        command = config.subcommand
        arguments = parser.instantiate(config)[command]
        arguments.pop("config", None)
        COMMANDS[command](**arguments)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    except (FloatingPointError, RequeueFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from err


def parse_command_line(argv: list[str], parser: Optional[ArgumentParser] = None):
    """The one way a command line becomes settings (for `fl-lightning` and for each grid point of a
    sweep): config files checked, algorithm short names and bare flags expanded, and any parse error
    restated as a ConfigError naming the field. Returns the parsed, not yet instantiated, namespace."""
    parser = parser or build_parser()
    check_config_files(argv)
    try:
        return parser.parse_args(expand_bare_flags(expand_short_names(argv)))
    except ArgumentError as err:
        raise explain_parse_error(str(err), argv) from err


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


def check_config_files(argv: list[str]) -> None:
    """Each `--config FILE` must be UTF-8 YAML holding a mapping; jsonargparse would otherwise fail
    with a traceback (binary file) or a message that names no file (empty file)."""
    for position, arg in enumerate(argv):
        if arg == "--config" and position + 1 < len(argv):
            value = argv[position + 1]
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        else:
            continue
        path = Path(value)
        if "\n" in value or "{" in value or ": " in value:
            continue  # a config given inline, not a file
        if not path.exists():
            raise ConfigError("config", "an existing YAML file", value)
        if not path.is_file():
            raise ConfigError("config", "a YAML file", f"{value} (not a file)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError("config", "a YAML text file", f"{value} (binary, not UTF-8 text)") from None
        except OSError as err:
            raise ConfigError("config", "a readable YAML file", f"{value} ({err.strerror})") from err
        try:
            content = yaml.safe_load(text)
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            problem = getattr(err, "problem", None) or type(err).__name__
            raise ConfigError("config", "a valid YAML file", f"{value} ({problem}{line})") from err
        if content is None:
            raise ConfigError("config", "a YAML mapping of settings (e.g. `federation: {rounds: 10}`)",
                              f"{value} (empty)")
        if not isinstance(content, dict):
            raise ConfigError("config", "a YAML mapping of settings (e.g. `federation: {rounds: 10}`)",
                              f"{value} (a {type(content).__name__})")


class UsageError(ConfigError):
    """A parse error restated as `<field>: expected ..., got ...`, where `got` is already worded."""

    def __init__(self, field_name: str, expected: str, got: str):
        ValueError.__init__(self, f"{field_name}: expected {expected}, got {got}")
        self.field_name = field_name


_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)'")
_NOT_ACCEPTED = re.compile(r"(?:Option|Key) '([^']+)' is not (?:accepted|expected)")
_CONFIG_KEY = re.compile(r"does not accept (?:option|key) '([^']+)'")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)", re.IGNORECASE | re.DOTALL)
_REQUIRED = re.compile(r'Key "([^"]+)" is required|arguments are required: ([\w.]+)')
_ARGUMENT = re.compile(r"(?:argument )?(--[\w.]+)(?:/\S+)?: (.*)", re.DOTALL)
_INVALID_CHOICE = re.compile(r'Invalid option "(.*)" for --([\w.]+)')
_GIVEN_VALUE = [
    re.compile(r"Got value: (.*)"),
    re.compile(r"Given value: (.*)"),
    re.compile(r"Not of type \w+: (.*?) does not conform"),
    re.compile(r"could not convert string to float: '(.*)'"),
    re.compile(r"invalid literal for int\(\) with base 10: '(.*)'"),
    re.compile(r"Expected a path but (.*?) either"),
    re.compile(r"Unable to load config '(.*)'"),
    re.compile(r"File does not exist: '(.*)'"),
]


def explain_parse_error(message: str, argv: list[str]) -> ConfigError:
    """One `<field>: expected ..., got ...` error for a jsonargparse/argparse parse error message."""
    command = next((arg for arg in argv if arg in COMMANDS), None)
    if command is None:
        given = next((arg for arg in argv if not arg.startswith("-")), None)
        return UsageError("command", f"one of {', '.join(COMMANDS)}",
                          "nothing" if given is None else repr(given))
    unknown = _unknown_key(message, argv)
    if unknown is not None:
        key, given, candidates = unknown
        return _unknown_key_error(key, given, candidates, command)
    required = _REQUIRED.search(message)
    if required:
        key = required.group(1) or required.group(2)
        key = key[len(command) + 1:] if key.startswith(f"{command}.") else key
        return UsageError(key, _expected(command, key, None), "nothing (it is required)")
    # A nested message repeats its key ('Parser key "federation": ... - Parser key "federation": ...').
    keys = [key for position, key in enumerate(_PARSER_KEY.findall(message))
            if position == 0 or key != _PARSER_KEY.findall(message)[position - 1]]
    argument = _ARGUMENT.match(message)
    if not keys and argument:
        key = argument.group(1).lstrip("-")
        if "expected one argument" in argument.group(2):
            return UsageError(key, f"a value after --{key}", "nothing")
        if key.endswith(".help"):  # --algorithm.help NAME
            return UsageError(key, _expected(command, key[: -len(".help")], None), _given(key, argv, message))
        return UsageError(key, argument.group(2).strip(), _given(key, argv, message))
    invalid_choice = _INVALID_CHOICE.search(message)
    if not keys and invalid_choice:  # --print_config=FLAGS
        return UsageError(invalid_choice.group(2), "skip_default, skip_unset, both or nothing",
                          repr(invalid_choice.group(1)))
    if not keys:
        first_line = message.strip().splitlines()[0] if message.strip() else "an unreadable command line"
        return UsageError("arguments", f"settings accepted by `fl-lightning {command} --help`", first_line)
    key = ".".join(keys)
    class_path = _CLASS_PATH.search(message)
    return UsageError(key, _expected(command, key, class_path and class_path.group(1), message),
                      _given(key, argv, message))


def _unknown_key(message: str, argv: list[str]) -> Optional[tuple[str, str, Optional[str]]]:
    """(key, what was given, the class path whose settings it is not among, if it is one) when the
    message is about an unknown key."""
    not_accepted = _NOT_ACCEPTED.search(message)
    if not_accepted:
        parents = _PARSER_KEY.findall(message)
        class_path = _CLASS_PATH.search(message)
        key = ".".join([*parents, not_accepted.group(1)])
        return key, _flag_given(key, argv), class_path.group(1) if class_path else None
    config_key = _CONFIG_KEY.search(message)
    if config_key:
        return config_key.group(1), f"{config_key.group(1)!r} in the config", None
    unrecognized = _UNRECOGNIZED.search(message)
    if unrecognized:
        tokens = unrecognized.group(1).split()
        flag = next((token for token in tokens if token.startswith("-")), tokens[0] if tokens else "")
        if not flag.startswith("-"):
            return "arguments", repr(flag), None
        return flag.lstrip("-").split("=", 1)[0], repr(flag.split("=", 1)[0]), None
    return None


def _unknown_key_error(key: str, given: str, class_path: Optional[str], command: str) -> ConfigError:
    if key == "arguments":
        return UsageError(key, "--group.field value pairs (no positional arguments)", given)
    group, _, last = key.rpartition(".")
    if class_path is not None:
        names = [f"{group}.{name}" for name in _init_parameters(class_path)]
        if not names:
            class_name = class_path.rpartition(".")[2]
            return UsageError(key, f"no setting under {group} ({class_name} takes none; give --{group} before "
                              "the settings of the class it names)", f"the unknown key {given}")
    else:
        names = setting_names(command)
        in_group = [name for name in names if name.startswith(group + ".")] if group else []
        names = in_group or [name for name in names if not any(n.startswith(name + ".") for n in names)]
    close = difflib.get_close_matches(key, names, n=2, cutoff=0.6)
    if not close and group:  # compare the last part with the fields of the same group
        fields = {name.rpartition(".")[2]: name for name in names}
        close = [fields[name] for name in difflib.get_close_matches(last, list(fields), n=2, cutoff=0.5)]
    if close:
        suggestion = "did you mean " + " or ".join(close) + "?"
    elif class_path is not None:
        suggestion = "one of " + ", ".join(names)
    else:
        suggestion = f"see `fl-lightning {command} --help`"
    return UsageError(key, f"a known setting ({suggestion})", f"the unknown key {given}")


def _flag_given(key: str, argv: list[str]) -> str:
    flag = f"--{key}"
    if any(arg == flag or arg.startswith(flag + "=") for arg in argv):
        return repr(flag)
    return f"{key!r} in the config"


def setting_names(command: str) -> list[str]:
    """Every `--name` the command accepts (groups and their fields), without the dashes."""
    names = ["config", "print_config", "help"]
    for name, annotation in _type_hints(COMMANDS[command]).items():
        if name == "return":
            continue
        names.append(name)
        group = _dataclass_in(annotation)
        if group is not None:
            names += [f"{name}.{field.name}" for field in dataclasses.fields(group)]
    return names


def _type_hints(function) -> dict:
    try:
        return typing.get_type_hints(function)
    except Exception:  # an annotation that cannot be resolved: help still works, messages get vaguer
        return {}


def _dataclass_in(annotation) -> Optional[type]:
    candidates = typing.get_args(annotation) if typing.get_origin(annotation) is Union else (annotation,)
    return next((c for c in candidates if dataclasses.is_dataclass(c)), None)


def _init_parameters(class_path: Optional[str]) -> list[str]:
    cls = _import_class(class_path)
    if cls is None:
        return []
    return [name for name, p in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _import_class(class_path: Optional[str]) -> Optional[type]:
    if not class_path or "." not in class_path:
        return None
    module_name, name = class_path.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return None


def _expected(command: str, key: str, class_path: Optional[str], message: str = "") -> str:
    """What the field accepts, from its type annotation."""
    if key == "config" or key.endswith(".config"):
        return "an existing YAML file of settings"
    hints = _type_hints(COMMANDS[command])
    annotation = None
    name, _, rest = key.partition(".")
    if name in hints:
        annotation = hints[name]
        if rest:
            group = _dataclass_in(annotation)
            cls = _import_class(class_path)
            if group is not None:
                annotation = _type_hints(group).get(rest)
            elif cls is not None:
                annotation = _type_hints(cls.__init__).get(rest.rpartition(".")[2])
            else:
                annotation = None
    if annotation is not None:
        return describe_type(annotation, name)
    detail = [line.strip(" -") for line in message.splitlines()[1:] if line.strip(" -")]
    return detail[-1] if detail else f"a value accepted by `fl-lightning {command} --help`"


def describe_type(annotation, field_name: str = "") -> str:
    """Plain words for what a type annotation accepts: `an integer > 0`, `one of a, b`, ..."""
    if annotation in TYPE_DESCRIPTIONS:
        return TYPE_DESCRIPTIONS[annotation]
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(str(value) for value in typing.get_args(annotation))
    if origin is Union:
        parts = [describe_type(arg, field_name) for arg in typing.get_args(annotation) if arg is not type(None)]
        if type(None) in typing.get_args(annotation):
            parts.append("null")
        return " or ".join(parts)
    if origin in (list, tuple) or annotation in (list, tuple):
        items = typing.get_args(annotation)
        return "a list" + (f" of {_plural(items[0])}" if items else "") + " (e.g. [a, b])"
    if origin is dict or annotation is dict:
        return "a mapping (e.g. {key: value})"
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a finite number"
    if annotation is str:
        return "a string"
    if inspect.isclass(annotation) and issubclass(annotation, Path):
        return "a path"
    if dataclasses.is_dataclass(annotation):
        fields = ", ".join(field.name for field in dataclasses.fields(annotation))
        return f"a mapping of {field_name or 'its'} settings ({fields}) or a YAML file of them"
    if annotation is Algorithm:
        return (f"an algorithm: one of {', '.join(sorted(SHORT_NAMES))}, or an Algorithm subclass "
                "by class name or class path")
    if inspect.isclass(annotation):
        names = sorted({cls.__name__ for cls in _subclasses(annotation) if not cls.__name__.startswith("_")
                        and not any(base.__module__.startswith("jsonargparse") for base in cls.__mro__)})
        return f"a {annotation.__name__}: one of {', '.join(names)} (class name or class path)"
    return str(annotation)


def _plural(annotation) -> str:
    return {str: "strings", int: "integers", float: "numbers"}.get(annotation, str(annotation))


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def _given(key: str, argv: list[str], message: str) -> str:
    """The value the user gave: from the command line if it is there, else from the message."""
    flag = f"--{key}"
    value = None
    for position, arg in enumerate(argv):
        if arg == flag and position + 1 < len(argv):
            value = argv[position + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    if value is not None:
        return repr(value)
    for pattern in _GIVEN_VALUE:
        found = pattern.search(message)
        if found:
            return repr(found.group(1).strip())
    return "an invalid value"


if __name__ == "__main__":
    main()
