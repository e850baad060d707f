"""The command line rewritten and checked before jsonargparse reads it: algorithm short names, bare
on/off flags, and the YAML loader of config files and inline values (which names algorithms as the
command line does); config files checked to be readable YAML mappings that choose at most one
algorithm, and every class path given to a class setting (`algorithm`, `server_optimizer`,
`constraint`, `callbacks`) checked to import and to be of that setting's class."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Callable, Mapping, Optional

import yaml
from jsonargparse import get_loader, set_loader

from fl_lightning.algorithms import FORMER_NAMES, SHORT_NAMES, Algorithm
from fl_lightning.cli.messages import class_in, describe_type
from fl_lightning.configurable import class_path_of, init_parameters, resolve_dotted_path, subclasses, why_unresolved
from fl_lightning.errors import ConfigError
from fl_lightning.participation import SHORT_NAMES as PARTICIPATION_NAMES
from fl_lightning.yaml_text import load_yaml

# Options whose value may be an algorithm's short name, and a participation model's.
ALGORITHM_OPTIONS = ("--algorithm", "--algorithm.help", "--algorithm.class_path")
PARTICIPATION_OPTIONS = ("--federation.participation", "--federation.participation.class_path")


def expand_short_names(argv: list[str]) -> list[str]:
    """`--algorithm fedprox` -> `--algorithm '{class_path: fl_lightning.algorithms.fedprox.FedProx}'`
    (also for a class name or class path): a mapping, which `explicit_algorithms` fills with the
    algorithm's defaults, so that an algorithm chosen on the command line after a config that chose
    another never inherits its hyper-parameters (FedCM's alpha as FedDyn's). `--algorithm.help NAME`
    and `--algorithm.class_path NAME` get the class path; other values pass through unchanged."""
    expanded = list(argv)
    for i, arg in enumerate(expanded):
        option, equals, value = arg.partition("=")
        if option not in ALGORITHM_OPTIONS + PARTICIPATION_OPTIONS:
            continue
        position = i if equals else i + 1
        if not equals:
            if position >= len(expanded):
                continue
            value = expanded[position]
        cls = algorithm_class(value) if option == "--algorithm" else None
        if cls is not None:
            value = f"{{class_path: {class_path_of(cls)}}}"
        elif option in PARTICIPATION_OPTIONS:
            if value not in PARTICIPATION_NAMES:
                continue
            value = class_path_of(PARTICIPATION_NAMES[value])
        elif (named := SHORT_NAMES.get(value) or FORMER_NAMES.get(value)) is not None:
            value = class_path_of(named)
        else:
            continue
        expanded[position] = f"{option}={value}" if equals else value
    return expanded


def expand_bare_flags(argv: list[str], commands: Mapping[str, Callable]) -> list[str]:
    """`--dry_run` -> `--dry_run=true` for an on/off setting of the command (one of `commands`) given
    with no value (the last argument, or one followed by another option), as flags read in any
    command line tool; `--dry_run false` is unchanged."""
    command = next((arg for arg in argv if arg in commands), None)
    if command is None:
        return argv
    flags = _bool_options(commands[command])
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
        if isinstance(settings, dict) and isinstance(settings.get("federation"), dict):
            _name_participation_by_class_path(settings["federation"])
    return value


def _name_participation_by_class_path(federation: dict) -> None:
    """`participation: cyclic` or `{class_path: cyclic, ...}` in a config's federation -> the class path."""
    spec = federation.get("participation")
    named = PARTICIPATION_NAMES.get(_named_class(spec)) if isinstance(_named_class(spec), str) else None
    if named is not None:
        federation["participation"] = ({**spec, "class_path": class_path_of(named)} if isinstance(spec, dict)
                                       else class_path_of(named))


def _explicit_algorithm(spec):
    cls = algorithm_class(_named_class(spec))
    if cls is None:
        return spec  # not an algorithm, or not one we can resolve: jsonargparse reports it
    given = spec.get("init_args", {}) if isinstance(spec, dict) else {}
    if not isinstance(given, dict):
        return spec
    defaults = {name: p.default for name, p in init_parameters(cls).items()
                if isinstance(p.default, (type(None), bool, int, float, str))}
    extra = {key: item for key, item in spec.items() if key not in ("class_path", "init_args")} \
        if isinstance(spec, dict) else {}
    return {"class_path": class_path_of(cls), "init_args": {**defaults, **given}, **extra}


def _named_class(spec):
    """What an algorithm setting names as its class: the value itself, or its class_path."""
    return spec.get("class_path") if isinstance(spec, dict) else spec


def algorithm_class(name) -> Optional[type]:
    """The Algorithm subclass that `name` (short name, class name or class path, or a former short name
    or class name of a renamed class) names; None when it names none, or a class path that does not
    resolve: jsonargparse then refuses it, and `explain_parse_error` names the cause."""
    if not isinstance(name, str):
        return None
    if (named := SHORT_NAMES.get(name) or FORMER_NAMES.get(name)) is not None:
        return named
    same_name = [cls for cls in subclasses(Algorithm) if cls.__name__ == name]
    if len(same_name) == 1:
        return same_name[0]
    try:
        cls = resolve_dotted_path(name)
    except Exception:  # not a class path, or one that `check_class_paths` refuses with its cause
        return None
    return cls if inspect.isclass(cls) and issubclass(cls, Algorithm) else None


set_loader(CONFIG_MODE, load_config_text, exceptions=(yaml.YAMLError,))


def check_config_files(argv: list[str]) -> None:
    """Each `--config FILE` must be UTF-8 YAML holding a mapping; jsonargparse would otherwise fail
    with a traceback (binary file) or a message that names no file (empty file). Algorithm files (a
    file that sets the algorithm and nothing else, as configs/algorithms/ holds) may not choose two
    algorithms: the later would silently replace the earlier and drop its settings (FedProx's mu
    under SCAFFOLD), while a run trains one. The algorithm of a file that sets more (a whole run,
    as configs/quickstart.yaml) is replaced by a later file's, as any of its settings is, and
    `--algorithm NAME` after the files replaces either."""
    chosen: Optional[tuple[str, type]] = None
    for value in _config_files(argv):
        content = _config_file_content(value)
        cls = algorithm_class(_named_class(_setting(content, "algorithm")))
        if cls is None or not _sets_only_the_algorithm(content):
            continue
        if chosen is not None and chosen[1] is not cls:
            raise ConfigError("config", "one algorithm file (a run trains one algorithm; to switch, give "
                              "--algorithm NAME instead of a second file)",
                              f"{chosen[0]} choosing {chosen[1].__name__} and {value} choosing {cls.__name__}")
        chosen = (value, cls)


def _sets_only_the_algorithm(content: dict) -> bool:
    fit_settings = content.get("fit")
    return set(content) == {"algorithm"} or (set(content) == {"fit"} and isinstance(fit_settings, dict)
                                             and set(fit_settings) == {"algorithm"})


def _config_files(argv: list[str]) -> list[str]:
    """The files given with `--config FILE` or `--config=FILE` (not the configs given inline)."""
    files = []
    for position, arg in enumerate(argv):
        if arg == "--config" and position + 1 < len(argv):
            value = argv[position + 1]
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        else:
            continue
        if not ("\n" in value or "{" in value or ": " in value):
            files.append(value)
    return files


def _config_file_content(value: str) -> dict:
    path = Path(value)
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
        content = load_yaml(text)
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
    return content


def _setting(content: dict, name: str):
    """The value a config file gives `name`, at the top or under `fit:` (a file given before the command)."""
    fit_settings = content.get("fit")
    if isinstance(fit_settings, dict) and name in fit_settings:
        return fit_settings[name]
    return content.get(name)


def check_class_paths(argv: list[str], command: Callable) -> None:
    """Every class path given to a class setting of `command` (`--algorithm`, `--callbacks`, ... and
    those settings in `--config` files) must import and name a class of the setting's type; refused
    otherwise with the cause: a missing module, a missing class, whatever the module raised while it
    was imported, or another class. jsonargparse would report these as the same `expected ...` or,
    for a module that raises, not at all (a traceback)."""
    settings = {name: annotation for name, annotation in typing.get_type_hints(command).items()
                if class_in(annotation) is not None}
    given: list[tuple[str, object]] = []
    for value in _config_files(argv):  # readable YAML mappings: check_config_files has seen to that
        content = load_yaml(Path(value).read_text(encoding="utf-8"))
        given += [(name, _setting(content, name)) for name in settings if _setting(content, name) is not None]
    for position, arg in enumerate(argv):
        option, equals, value = arg.partition("=")
        name = option.removeprefix("--").removesuffix("+").removesuffix(".class_path")
        if name in settings and option.startswith("--"):
            if not equals:
                if position + 1 == len(argv):
                    continue
                value = argv[position + 1]
            if not Path(value).is_file():  # a file of the setting's own is read by jsonargparse
                given.append((name, _yaml_value(value)))
    for name, value in given:
        for path in _class_paths(value):
            _check_class_path(name, settings[name], path)


def _yaml_value(text: str):
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        return text  # jsonargparse reports it


def _class_paths(value) -> list[str]:
    """The dotted class paths a class setting's value names: itself, its class_path, or its items'."""
    if isinstance(value, list):
        return [path for item in value for path in _class_paths(item)]
    named = _named_class(value)
    return [named] if isinstance(named, str) and "." in named else []


def _check_class_path(name: str, annotation, path: str) -> None:
    base = class_in(annotation)
    try:
        cls = resolve_dotted_path(path)
    except ValueError:
        return  # not a dotted path: jsonargparse reports it
    except Exception as err:  # whatever the user's module raises on import is theirs to see, in one line
        raise ConfigError(name, describe_type(annotation, name), why_unresolved(path, err)) from err
    if not (inspect.isclass(cls) and issubclass(cls, base)):
        raise ConfigError(name, describe_type(annotation, name), f"{path} (not a subclass of {base.__name__})")
