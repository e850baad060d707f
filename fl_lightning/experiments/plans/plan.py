"""Sweep plans: a YAML file naming a grid of runs, methods x settings x seeds.

    name: fedconst_table3                 # names runs/<name>/ and the W&B tag
    configs: [configs/settings/a.yaml]    # fragments every run starts from
    methods:                              # the table's rows: name -> what makes the method
      FedAvg: [configs/algorithms/fedavg.yaml]
      FedAvg + CONST: [configs/algorithms/fedavg.yaml, configs/const.yaml]
      CTP-FL h=0: [configs/algorithms/ctpfl.yaml, {algorithm.init_args.span: 0.0}]
    settings:                             # the table's columns: the product of these axes
      dataset: {cifar10: [{data.name: cifar10}], cifar100: [configs/data/cifar100.yaml]}
      alpha: {"0.5": [{data.alpha: 0.5}]}
    seeds: [0, 1, 2]
    reference: references/fedconst_table1.csv   # optional: the paper's numbers (see table.py)
    metric: test_accuracy                       # optional: what the table reports
    resources:                                  # optional: what each run needs (see resources.py)
      gpus_per_run: 4          # GPUs (one rank each) of every run: the sweep's default --gpus_per_run;
                               # a plan asking for GPUs is refused where its runs would get none
      precision: bf16-mixed    # fabric.precision of every run (given before the plan's configs)
      time_per_run: "24:00:00" # SLURM time limit of each array task (sbatch --time), quoted
    tune:                                       # optional: each method's own values chosen per setting (tuning.py)
      seeds: [100]                              # the tuning runs' seeds, none of `seeds`
      select: val_accuracy                      # a validation metric; the lowest wins for a loss
      at: final                                 # optional: final, best or last:K, as table's --at
      choose_from: all                          # optional: all (a complete stage), or finished (tuning.py)
      methods:                                  # a method -> {dotted setting: [values]}, the product its candidates
        FedAvg: {client_optimizer.lr: [0.01, 0.03, 0.1]}

Each list holds config fragments (paths, relative to the working folder) and mappings of dotted
settings. A run is `fl-lightning fit` with the plan's configs, then each setting axis's, then the
method's (so a method always carries its own hyper-parameters, whatever the setting), then the
seed, then the command line's `--override KEY=VALUE` (overrides.py: an override that changes the
experiment makes a variant of the plan, `<plan>@<hint>-<digest>`, with runs of its own), its out_dir
runs/<plan>/<setting>/<method>/seed<k> and its W&B names.

A plan with `tune:` runs a tuning stage first: for every setting and tuned method, each candidate
(one value of each of its tuned settings) on each tuning seed, in
runs/<plan>/tune/<setting>/<method>/<candidate>/seed<k> (grid points 0 to T-1; the plan's own
runs follow them). A tuned method's own runs then take the candidate that tuning.py chose for their
setting, as a mapping after the method's parts; until it is chosen they are `waiting`. A tuned
setting that a setting axis's mappings set is refused (the axis's columns would train the candidates).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional, Union

import yaml

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.overrides import (
    changes_the_experiment,
    parse_overrides,
    value_text,
    variant_name,
)
from fl_lightning.experiments.plans.resources import PlanResources, read_resources
from fl_lightning.experiments.plans.tune_grid import (
    TuneGrid,
    candidate_name,
    check_seeds,
    describe_candidate,
    read_tune,
)
from fl_lightning.metric_names import TEST_ACCURACY
from fl_lightning.yaml_text import load_yaml

Part = Union[str, dict]
"""A config fragment's path, or a mapping of dotted settings."""


@dataclass
class GridPoint:
    """One run of a plan."""

    index: int
    method: str
    setting: dict[str, str]
    """Axis name -> the value chosen on that axis."""
    seed: int
    parts: list[Part]
    out_dir: Path
    plan_name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted setting -> value, given after the seed (the command line's --override)."""
    tuning: bool = False
    """A run of the plan's tuning stage (on a tuning seed), not one of the plan's own runs."""
    tuned: dict[str, Any] = field(default_factory=dict)
    """The tuned settings among its parts, after the method's: a tuning point's candidate, a tuned
    method's chosen values (while `waiting`, its first candidate, which stands in for the checks and
    the estimate only)."""
    waiting: bool = False
    """A run of a tuned method whose setting has no choice yet: never trained nor tabulated."""

    @property
    def setting_name(self) -> str:
        return _name_of(self.setting)

    @property
    def label(self) -> str:
        """The method, or for a tuning point `<method> (tuning <candidate>)`."""
        return f"{self.method} (tuning {describe_candidate(self.tuned)})" if self.tuning else self.method

    @property
    def cell(self) -> tuple[str, str]:
        """(setting name, method): what a tuning choice is made for."""
        return self.setting_name, self.method

    def fit_arguments(self) -> list[str]:
        """The `fl-lightning fit` command line of this run (without the program name)."""
        arguments = ["fit"]
        for part in self.parts:
            if isinstance(part, str):
                arguments += ["--config", part]
            else:
                for key, value in part.items():
                    arguments += [f"--{key}", value_text(value)]
        arguments += ["--seed", str(self.seed)]
        for key, value in self.overrides.items():
            arguments += [f"--{key}", value_text(value)]
        group, name, plan_tag = self._wandb_names()
        return arguments + [
            "--out_dir", str(self.out_dir), "--resume", "auto", "--logger.group", group,
            "--logger.name", f"{name}-seed{self.seed}",
            # The plan's method name replaces fit's own `method=` tag; these three are also keys of the W&B config.
            "--logger.tags", f"[{plan_tag}={self.plan_name}, method={slug(self.method)}, setting={self.setting_name}]",
        ]

    def _wandb_names(self) -> tuple[str, str, str]:
        """Its W&B group, its name before the seed, and the key of its plan's tag. One method per group
        (W&B averages a group): a group is a cell's seeds, a tuning candidate's apart. A tuning run is
        tagged tune=<plan>, not plan=<plan>, so that the plan's dashboard (its runs tagged plan=<plan>)
        never averages a candidate in."""
        name = slug(self.method)
        if not self.tuning:
            return f"{self.plan_name}-{self.setting_name}-{name}", name, "plan"
        name = f"{name}-{candidate_name(self.tuned)}"
        return f"{self.plan_name}-tune-{self.setting_name}-{name}", name, "tune"


@dataclass(frozen=True)
class Plan:
    """A plan file as read, with the command line's overrides: a value, named for its variant once
    resolve.settle_variant has decided which overrides change a point."""

    name: str
    configs: list[Part]
    methods: dict[str, list[Part]]
    settings: dict[str, dict[str, list[Part]]]
    seeds: list[int]
    path: Path
    reference: Optional[Path] = None
    metric: str = TEST_ACCURACY
    runs_root: Path = field(default=Path("runs"))
    resources: PlanResources = field(default_factory=PlanResources)
    overrides: dict[str, Any] = field(default_factory=dict)
    """The command line's --override, applied last to every point; `name` is then the variant's."""
    base_name: str = ""
    """The plan file's own name (`name` without the variant)."""
    restated: frozenset[str] = frozenset()
    """Overrides that restate what every point already has (resolve.settle_variant): they name no variant."""
    tune: Optional[TuneGrid] = None

    @property
    def variant_overrides(self) -> dict[str, Any]:
        """The overrides that make this plan a variant of its file's ({} for the plan's own runs)."""
        return {key: value for key, value in self.overrides.items()
                if key not in self.restated and changes_the_experiment(key)}

    def restating(self, keys: frozenset[str]) -> "Plan":
        """The plan named for its overrides but `keys`, which change nothing at any point
        (resolve.settle_variant decides which)."""
        kept = {key: value for key, value in self.overrides.items() if key not in keys}
        return dataclasses.replace(self, restated=keys, name=variant_name(self.base_name, kept))

    def grid(self, choices: Optional[dict[tuple[str, str], dict[str, Any]]] = None) -> list[GridPoint]:
        """The plan's own runs, after the tuning points: settings outermost, then methods, then seeds
        (seeds of a cell are neighbours). A tuned method's run takes its cell's values in `choices`
        ((setting name, method) -> the values chosen: tuning.py reads them from the selections); a
        run without them is `waiting`."""
        points, first = [], len(self.tuning_grid())
        for setting, setting_parts in self._settings():
            for method in self.methods:
                candidates = self.tune.candidates(method) if self.tune is not None else []
                chosen = (choices or {}).get((_name_of(setting), method))
                tuned = chosen if chosen is not None else (candidates[0] if candidates else {})
                for seed in self.seeds:
                    out_dir = self.runs_root / self.name / _name_of(setting) / slug(method) / f"seed{seed}"
                    points.append(self._point(first + len(points), method, setting, seed,
                                              setting_parts, tuned, out_dir, waiting=bool(candidates) and not chosen))
        return points

    def tuning_grid(self) -> list[GridPoint]:
        """The tuning stage's runs (grid points 0 to T-1): settings outermost, then the tuned methods,
        then their candidates in the plan's order, then the tuning seeds."""
        if self.tune is None:
            return []
        points = []
        for setting, setting_parts in self._settings():
            for method in [method for method in self.methods if method in self.tune.methods]:
                for candidate in self.tune.candidates(method):
                    for seed in self.tune.seeds:
                        out_dir = self.tune_folder(_name_of(setting), method) / candidate_name(candidate) / \
                            f"seed{seed}"
                        points.append(self._point(len(points), method, setting, seed, setting_parts, candidate,
                                                  out_dir, tuning=True))
        return points

    def tune_folder(self, setting_name: str, method: str) -> Path:
        """Where a cell's tuning runs and its selection go: runs/<plan>/tune/<setting>/<method>."""
        return self.runs_root / self.name / "tune" / setting_name / slug(method)

    def _settings(self) -> list[tuple[dict[str, str], list[Part]]]:
        """Every column: its axis values and their parts."""
        axes = list(self.settings.items())
        return [({axis: value for (axis, _), value in zip(axes, values)},
                 [part for (axis, choices), value in zip(axes, values) for part in choices[value]])
                for values in itertools.product(*[list(choices) for _, choices in axes])]

    def _point(self, index: int, method: str, setting: dict[str, str], seed: int, setting_parts: list[Part],
               tuned: dict[str, Any], out_dir: Path, tuning: bool = False, waiting: bool = False) -> GridPoint:
        parts = [*self._resource_parts(), *self.configs, *setting_parts, *self.methods[method],
                 *([dict(tuned)] if tuned else [])]
        return GridPoint(index=index, method=method, setting=setting, seed=seed, parts=parts, out_dir=out_dir,
                         plan_name=self.name, overrides=dict(self.overrides), tuning=tuning, tuned=dict(tuned),
                         waiting=waiting)

    def _resource_parts(self) -> list[Part]:
        return [] if self.resources.precision is None else [{"fabric.precision": self.resources.precision}]


def _name_of(setting: dict[str, str]) -> str:
    """A setting's folder name: `<axis>-<value>_<axis>-<value>...`, or `default` without axes."""
    return "_".join(f"{axis}-{value}" for axis, value in setting.items()) or "default"


def slug(name: str) -> str:
    """A folder- and tag-safe form of a method name: "FedAvg + CONST" -> "fedavg+const"."""
    return re.sub(r"[^a-z0-9+=._-]+", "-", name.lower().replace(" + ", "+")).strip("-")


def load_plan(path: Path, runs_root: Path = Path("runs"), overrides: Optional[list[str]] = None) -> Plan:
    """Read and check a plan file; every problem is a ConfigError naming the plan's key. `overrides`
    (KEY=VALUE, the command line's --override) are applied last to every point (see overrides.py)."""
    path = Path(path)
    try:
        raw = load_yaml(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError("plan", "a readable YAML plan file", f"{path} ({err})") from err
    read = PlanFile.read(raw, default_name=path.stem)
    parsed_overrides = parse_overrides(overrides)
    return Plan(name=variant_name(read.name, parsed_overrides), base_name=read.name, tune=read.tune,
                resources=read.resources, overrides=parsed_overrides, configs=read.configs, methods=read.methods,
                settings={a: {str(v): p for v, p in c.items()} for a, c in read.settings.items()}, seeds=read.seeds,
                path=path, reference=None if read.reference is None else Path(read.reference), metric=read.metric,
                runs_root=runs_root)


def _read_name(name, plan: dict) -> str:
    if not isinstance(name, str) or slug(name) != name:
        raise ConfigError("plan.name", "a name of lower-case letters, digits and - _ . +", name)
    return name


def _read_methods(methods, plan: dict) -> dict:
    if not isinstance(methods, dict) or not methods:
        raise ConfigError("plan.methods", "a mapping of method name -> list of config fragments", methods)
    _check_distinct_folders("plan.methods", {str(method): slug(str(method)) for method in methods})
    for method, parts in methods.items():
        _check_parts(f"plan.methods.{method}", parts)
    return methods


def _read_settings(settings, plan: dict) -> dict:
    settings = settings or {}
    if not isinstance(settings, dict) or not all(isinstance(c, dict) and c for c in settings.values()):
        raise ConfigError("plan.settings", "a mapping of axis -> {value name: list of config fragments}", settings)
    for axis, choices in settings.items():
        if not isinstance(axis, str) or not _AXIS_NAME.fullmatch(axis):
            raise ConfigError("plan.settings", "axis names of letters, digits and . + = (a run folder is named "
                              "<axis>-<value>_<axis>-<value>...)", axis)
        _check_distinct_folders(f"plan.settings.{axis}", {str(value): str(value) for value in choices},
                                given=len(choices))
        for value, parts in choices.items():
            _check_parts(f"plan.settings.{axis}.{value}", parts)
    return settings


def _read_configs(configs, plan: dict) -> list:
    configs = configs or []
    _check_parts("plan.configs", configs)
    return configs


def _read_seeds(seeds, plan: dict) -> list:
    check_seeds("plan.seeds", seeds)
    return seeds


def _read_text(key: str) -> Callable[[Any, dict], Any]:
    def read(value, plan: dict):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"plan.{key}", "a string", value)
        return value
    return read


def _key(read: Callable[[Any, dict], Any], default: Any = None, required: bool = False):
    """A plan file's key: how its value is read and checked (given the plan read so far), its default."""
    return field(default=None, metadata={"read": read, "default": default, "required": required})


@dataclass
class PlanFile:
    """A plan file's keys, one typed field each, in the order the plan's docstring gives them: a field's
    `read` checks the key's value (naming `plan.<key>` when it is wrong) and gives the value of its type
    that the plan holds. A new key is one field here."""

    name: str = _key(_read_name)
    """Default: the file's name without its suffix."""
    configs: list[Part] = _key(_read_configs, default=[])
    methods: dict[str, list[Part]] = _key(_read_methods, required=True)
    settings: dict[str, dict[str, list[Part]]] = _key(_read_settings, default={})
    seeds: list[int] = _key(_read_seeds, default=[0])
    reference: Optional[str] = _key(_read_text("reference"))
    metric: str = _key(_read_text("metric"), default=TEST_ACCURACY)
    resources: PlanResources = _key(lambda value, plan: read_resources(value))
    tune: Optional[TuneGrid] = _key(lambda value, plan: read_tune(value, plan))

    @classmethod
    def read(cls, raw, default_name: str) -> "PlanFile":
        keys = [key.name for key in fields(cls)]
        if not isinstance(raw, dict):
            raise ConfigError("plan", "a mapping with name, methods, settings and seeds", raw)
        unknown = set(raw) - set(keys)
        if unknown:
            raise ConfigError("plan", f"only the keys {', '.join(keys)}", sorted(unknown))
        raw = {key: value for key, value in raw.items() if value is not None}
        raw["name"] = raw.get("name") or default_name
        plan = {}
        for key in fields(cls):
            given = raw.get(key.name, key.metadata["default"])
            if key.metadata["required"] and given is None:
                raise ConfigError(f"plan.{key.name}", "a value: the key is required", None)
            plan[key.name] = key.metadata["read"](given, {**raw, **plan})
        return cls(**plan)


_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9+=.-]*")
"""A method's folder (its slug) or a setting value: one folder name, never `.`, `..` or a path."""
_AXIS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9+=.]*")
"""No `-` or `_`: they separate axis from value and axis from axis in a setting's folder name."""


def _check_distinct_folders(key: str, folders: dict[str, str], given: Optional[int] = None) -> None:
    """Each name -> its folder name: each a safe folder name, and no two the same (nor two YAML keys
    that read as one name, 0.5 and "0.5")."""
    for name, folder in folders.items():
        if not _FOLDER_NAME.fullmatch(folder):
            raise ConfigError(key, "names safe as one folder name (letters, digits and + = . -, starting with a "
                              "letter or digit)", name)
    by_folder: dict[str, list[str]] = {}
    for name, folder in folders.items():
        by_folder.setdefault(folder, []).append(name)
    shared = [names for names in by_folder.values() if len(names) > 1]
    if shared or (given is not None and given != len(folders)):
        raise ConfigError(key, "names that stay distinct as folder names (two would share one run folder)",
                          shared[0] if shared else list(folders))


def _check_parts(key: str, parts) -> None:
    if not isinstance(parts, list):
        raise ConfigError(key, "a list of config fragment paths and {dotted.setting: value} mappings", parts)
    for part in parts:
        if isinstance(part, str):
            if not Path(part).is_file():
                raise ConfigError(key, "config fragments that exist (paths are relative to the working folder)",
                                  part)
        elif not isinstance(part, dict):
            raise ConfigError(key, "a config fragment path or a {dotted.setting: value} mapping", part)
