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

Each list holds config fragments (paths, relative to the working folder) and mappings of dotted
settings. A run is `fl-lightning fit` with the plan's configs, then each setting axis's, then the
method's (so a method always carries its own hyper-parameters, whatever the setting), then the
seed, then the command line's `--override KEY=VALUE` (overrides.py: an override that changes the
experiment makes a variant of the plan, `<plan>@<hint>-<digest>`, with runs of its own), its out_dir
runs/<plan>/<setting>/<method>/seed<k> and its W&B names.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.overrides import changes_the_experiment, parse_overrides, value_text, variant_name
from fl_lightning.experiments.resources import PlanResources, read_resources
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

    @property
    def setting_name(self) -> str:
        return "_".join(f"{axis}-{value}" for axis, value in self.setting.items()) or "default"

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
        return arguments + [
            "--out_dir", str(self.out_dir), "--resume", "auto",
            # One method per W&B group (W&B averages a group): a group is a cell's seeds.
            "--logger.group", f"{self.plan_name}-{self.setting_name}-{slug(self.method)}",
            "--logger.name", f"{slug(self.method)}-seed{self.seed}",
            # The plan's method name replaces fit's own `method=` tag; these three are also keys of the W&B config.
            "--logger.tags", f"[plan={self.plan_name}, method={slug(self.method)}, setting={self.setting_name}]",
        ]


@dataclass
class Plan:
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
    """Overrides that restate what every point already has (resolve.resolve_variant): they name no variant."""

    @property
    def variant_overrides(self) -> dict[str, Any]:
        """The overrides that make this plan a variant of its file's ({} for the plan's own runs)."""
        return {key: value for key, value in self.overrides.items()
                if key not in self.restated and changes_the_experiment(key)}

    def restate(self, keys: set[str]) -> bool:
        """Name the plan for its overrides but `keys`, which change nothing at any point; True when
        that renames it (its points' folders and W&B names are then the new name's)."""
        self.restated = frozenset(keys)
        name = variant_name(self.base_name, {k: v for k, v in self.overrides.items() if k not in self.restated})
        renamed, self.name = name != self.name, name
        return renamed

    def grid(self) -> list[GridPoint]:
        """Every run, settings outermost, then methods, then seeds (seeds of a cell are neighbours)."""
        axes = list(self.settings.items())
        points = []
        for values in itertools.product(*[list(choices) for _, choices in axes]):
            setting = {axis: value for (axis, _), value in zip(axes, values)}
            setting_parts = [part for (axis, choices), value in zip(axes, values) for part in choices[value]]
            for method, method_parts in self.methods.items():
                for seed in self.seeds:
                    point = GridPoint(index=len(points), method=method, setting=setting, seed=seed,
                                      parts=[*self._resource_parts(), *self.configs, *setting_parts, *method_parts],
                                      out_dir=Path(), plan_name=self.name, overrides=dict(self.overrides))
                    point.out_dir = self.runs_root / self.name / point.setting_name / slug(method) / f"seed{seed}"
                    points.append(point)
        return points

    def _resource_parts(self) -> list[Part]:
        return [] if self.resources.precision is None else [{"fabric.precision": self.resources.precision}]


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
    if not isinstance(raw, dict):
        raise ConfigError("plan", "a mapping with name, methods, settings and seeds", str(path))
    unknown = set(raw) - {"name", "configs", "methods", "settings", "seeds", "reference", "metric", "resources"}
    if unknown:
        raise ConfigError("plan", "only the keys name, configs, methods, settings, seeds, reference, metric, "
                          "resources", sorted(unknown))
    name = raw.get("name") or path.stem
    if not isinstance(name, str) or slug(name) != name:
        raise ConfigError("plan.name", "a name of lower-case letters, digits and - _ . +", name)
    methods = raw.get("methods")
    if not isinstance(methods, dict) or not methods:
        raise ConfigError("plan.methods", "a mapping of method name -> list of config fragments", methods)
    _check_distinct_folders("plan.methods", {str(method): slug(str(method)) for method in methods})
    settings = raw.get("settings") or {}
    if not isinstance(settings, dict) or not all(isinstance(c, dict) and c for c in settings.values()):
        raise ConfigError("plan.settings", "a mapping of axis -> {value name: list of config fragments}", settings)
    for axis, choices in settings.items():
        if not isinstance(axis, str) or not _AXIS_NAME.fullmatch(axis):
            raise ConfigError("plan.settings", "axis names of letters, digits and . + = (a run folder is named "
                              "<axis>-<value>_<axis>-<value>...)", axis)
        _check_distinct_folders(f"plan.settings.{axis}", {str(value): str(value) for value in choices},
                                given=len(choices))
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise ConfigError("plan.seeds", "a non-empty list of integers >= 0", seeds)
    if len(set(seeds)) != len(seeds):
        raise ConfigError("plan.seeds", "distinct seeds (a seed given twice is one run folder, counted twice in "
                          "the table)", seeds)
    parts = {"plan.configs": raw.get("configs") or [],
             **{f"plan.methods.{m}": p for m, p in methods.items()},
             **{f"plan.settings.{a}.{v}": p for a, c in settings.items() for v, p in c.items()}}
    for key, value in parts.items():
        _check_parts(key, value)
    reference = raw.get("reference")
    parsed_overrides = parse_overrides(overrides)
    return Plan(name=variant_name(name, parsed_overrides), base_name=name,
                resources=read_resources(raw.get("resources")), overrides=parsed_overrides,
                configs=raw.get("configs") or [], methods=methods,
                settings={a: {str(v): p for v, p in c.items()} for a, c in settings.items()}, seeds=seeds, path=path,
                reference=None if reference is None else Path(reference), metric=raw.get("metric", TEST_ACCURACY),
                runs_root=runs_root)


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
