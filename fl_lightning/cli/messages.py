"""Parse errors restated: every bad input ends in one line, `error: <field>: expected ..., got ...`.
jsonargparse's and argparse's messages are rewritten here, with the expected value taken from the
field's type and, for an unknown key, the closest valid names. fl-lightning's own warnings are one
line too, `warning: <text>` (`one_line_warnings`)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import re
import typing
import warnings
from pathlib import Path
from typing import Callable, Literal, Mapping, Optional, Union

from fl_lightning.algorithms import SHORT_NAMES, Algorithm
from fl_lightning.config import TYPE_DESCRIPTIONS
from fl_lightning.configurable import init_parameters, resolve_dotted_path, subclasses
from fl_lightning.errors import ConfigError, RunWarning


class UsageError(ConfigError):
    """A parse error restated as `<field>: expected ..., got ...`, where `got` is already worded."""

    def __init__(self, field_name: str, expected: str, got: str):
        ValueError.__init__(self, f"{field_name}: expected {expected}, got {got}")
        self.field_name = field_name


@contextlib.contextmanager
def one_line_warnings():
    """While it lasts, fl-lightning's own warnings (`RunWarning`) are shown as one line, `warning: <text>`,
    as the command's errors are, not as Python shows a warning (its file, line and code, which tell a
    user nothing); every other warning (a library's) is shown as Python shows it. Only the wording
    changes (`warnings.formatwarning`): where a warning goes and whether it is shown stay Python's (a
    test's `pytest.warns` still records it)."""
    format_warning = warnings.formatwarning

    def format_one_line(message, category, filename, lineno, line=None) -> str:
        if issubclass(category, RunWarning):
            return f"warning: {message}\n"
        return format_warning(message, category, filename, lineno, line)

    warnings.formatwarning = format_one_line
    try:
        yield
    finally:
        warnings.formatwarning = format_warning


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


def explain_parse_error(message: str, argv: list[str], commands: Mapping[str, Callable]) -> ConfigError:
    """One `<field>: expected ..., got ...` error for a jsonargparse/argparse parse error message of
    the command line `argv` of one of `commands` (name -> the function whose signature is its schema)."""
    command = next((arg for arg in argv if arg in commands), None)
    if command is None:
        given = next((arg for arg in argv if not arg.startswith("-")), None)
        return UsageError("command", f"one of {', '.join(commands)}",
                          "nothing" if given is None else repr(given))
    function = commands[command]
    unknown = _unknown_key(message, argv)
    if unknown is not None:
        key, given, candidates = unknown
        return _unknown_key_error(key, given, candidates, command, function)
    required = _REQUIRED.search(message)
    if required:
        key = required.group(1) or required.group(2)
        key = key[len(command) + 1:] if key.startswith(f"{command}.") else key
        return UsageError(key, _expected(command, function, key, None), "nothing (it is required)")
    # A nested message repeats its key ('Parser key "federation": ... - Parser key "federation": ...').
    keys = [key for position, key in enumerate(_PARSER_KEY.findall(message))
            if position == 0 or key != _PARSER_KEY.findall(message)[position - 1]]
    argument = _ARGUMENT.match(message)
    if not keys and argument:
        key = argument.group(1).lstrip("-")
        if "expected one argument" in argument.group(2):
            return UsageError(key, f"a value after --{key}", "nothing")
        if key.endswith(".help"):  # --algorithm.help NAME
            return UsageError(key, _expected(command, function, key[: -len(".help")], None),
                              _given(key, argv, message))
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
    return UsageError(key, _expected(command, function, key, class_path and class_path.group(1), message),
                      _given(key, argv, message))


def class_in(annotation) -> Optional[type]:
    """The class an annotation takes by class path (`algorithm`, `callbacks`): itself, or inside a list
    or Optional; None for settings of other types."""
    if inspect.isclass(annotation) and not dataclasses.is_dataclass(annotation) \
            and not issubclass(annotation, (bool, int, float, str, dict, list, tuple, Path, type(None))):
        return annotation
    for argument in typing.get_args(annotation):
        found = class_in(argument)
        if found is not None:
            return found
    return None


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


def _unknown_key_error(key: str, given: str, class_path: Optional[str], command: str, function: Callable
                       ) -> ConfigError:
    if key == "arguments":
        return UsageError(key, "--group.field value pairs (no positional arguments)", given)
    group, _, last = key.rpartition(".")
    if class_path is not None:
        cls = _resolved_class(class_path)
        names = [f"{group}.{name}" for name in (init_parameters(cls) if cls is not None else [])]
        if not names:
            class_name = class_path.rpartition(".")[2]
            return UsageError(key, f"no setting under {group} ({class_name} takes none; give --{group} before "
                              "the settings of the class it names)", f"the unknown key {given}")
    else:
        names = setting_names(function)
        in_group = [name for name in names if name.startswith(group + ".")] if group else []
        names = in_group or [name for name in names if not any(n.startswith(name + ".") for n in names)]
    # Within a group the fields' own names are compared first: compared whole, every name shares the group's
    # prefix, and a field that only shares a few letters scores as close as a near miss.
    real_group = bool(group) and all(name.startswith(group + ".") for name in names)
    fields = {name.rpartition(".")[2]: name for name in names} if real_group else {}
    close = [fields[name] for name in difflib.get_close_matches(last, list(fields), n=2, cutoff=0.6)]
    close = close or difflib.get_close_matches(key, names, n=2, cutoff=0.6)
    if not close and real_group:
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


def setting_names(function: Callable) -> list[str]:
    """Every `--name` the command whose schema is `function` accepts (groups and their fields), without
    the dashes."""
    names = ["config", "print_config", "help"]
    for name, annotation in _type_hints(function).items():
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


def _resolved_class(class_path: Optional[str]) -> Optional[type]:
    """The class at `class_path`, or None when it names none: only a message is being worded (a class
    path that does not resolve was refused, with its cause, before parsing: `check_class_paths`)."""
    if not class_path:
        return None
    try:
        cls = resolve_dotted_path(class_path)
    except Exception:
        return None
    return cls if inspect.isclass(cls) else None


def _expected(command: str, function: Callable, key: str, class_path: Optional[str], message: str = "") -> str:
    """What the field accepts, from its type annotation."""
    if key == "config" or key.endswith(".config"):
        return "an existing YAML file of settings"
    hints = _type_hints(function)
    annotation = None
    name, _, rest = key.partition(".")
    if name in hints:
        annotation = hints[name]
        if rest:
            group = _dataclass_in(annotation)
            cls = _resolved_class(class_path)
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
        if items and class_in(items[0]) is items[0]:
            return f"a list of {items[0].__name__} subclasses (e.g. [{{class_path: module.Class}}])"
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
        names = sorted({cls.__name__ for cls in subclasses(annotation) if not cls.__name__.startswith("_")
                        and not any(base.__module__.startswith("jsonargparse") for base in cls.__mro__)})
        return f"a {annotation.__name__}: one of {', '.join(names)} (class name or class path)"
    return str(annotation)


def _plural(annotation) -> str:
    return {str: "strings", int: "integers", float: "numbers"}.get(annotation, str(annotation))


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
