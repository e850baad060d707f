"""What `fl-lightning table` tabulates: the runs a plan's grid expects (or several plans', as one
table), or run folders, each an entry with its row, column and seed, and the columns' labels."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from fl_lightning.data import dataset_label
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.overrides import SET_BY_THE_PLAN, value_text
from fl_lightning.experiments.plans.plan import GridPoint, load_plan
from fl_lightning.experiments.plans.resolve import GridResolver, accepted_config, settle_variant
from fl_lightning.experiments.plans.tune_grid import describe_candidate, same_setting
from fl_lightning.experiments.plans.tuning import TunedGrid
from fl_lightning.experiments.results.reference import paper_numbers
from fl_lightning.experiments.runs import RunFolder, find_runs
from fl_lightning.metric_names import TEST_ACCURACY
from fl_lightning.models import model_label
from fl_lightning.run_dir import defining_settings, flatten
from fl_lightning.run_logging import METRICS_FILE


@dataclass
class Entry:
    """A run the table expects: its row, column, seed and folder, and with a plan its grid point."""

    method: str
    setting: str
    seed: int
    path: Path
    point: Optional[GridPoint] = None
    """None without a plan."""
    plan_file: Optional[Path] = None
    resolver: Optional[GridResolver] = field(default=None, repr=False, compare=False)
    unimportable: Optional[str] = None
    """The module of the user's (an algorithm's, a model's, a dataset's) that the point names and this
    process cannot import (not on PYTHONPATH): the run is read as its config.yaml recorded it,
    unchecked against its point (set by `config`)."""

    @functools.cached_property
    def config(self) -> Optional[dict]:
        """The settings `fit` builds for the run's grid point, resolved when first asked for (a table of
        one plan asks for those of the points that have runs); the plan is refused if `fit` would
        refuse them. Where they name a module of the user's that this process cannot import, and the
        run folder records the settings it was made with, those (and `unimportable` names the module).
        None without a plan."""
        if self.point is None:
            return None
        resolved = self.resolver.resolve(self.point)
        if resolved.error is not None:
            self.unimportable = _unimportable_module(resolved.error, RunFolder(self.path).config)
            if self.unimportable is not None:
                return RunFolder(self.path).config
        return accepted_config(self.plan_file, resolved)

    @property
    def rounds(self) -> Optional[int]:
        return None if self.config is None else self.config["federation"]["rounds"]


def _unimportable_module(error: Exception, recorded: dict) -> Optional[str]:
    """The top module of a dotted path in the recorded settings that cannot be imported here, where the
    error of resolving the point is that module's absence; None otherwise."""
    paths = [value for value in flatten(recorded).values() if isinstance(value, str) and _DOTTED_PATH.fullmatch(value)]
    missing = {path.split(".")[0] for path in paths if importlib.util.find_spec(path.split(".")[0]) is None}
    return next((module for module in sorted(missing) if f"No module named '{module}'" in str(error)), None)


@dataclass
class Loaded:
    entries: list[Entry]
    methods: list[str]
    settings: list[str]
    labels: dict[str, str]
    metric: str
    reference: Optional[Path]
    out: Path
    plan_file: Optional[Path] = None
    papers: Optional[dict[tuple[str, str], Optional[float]]] = None
    """(row, setting) -> the paper's number, from each plan's reference: a table of several plans."""
    name: str = ""
    """The plan's name (its variant's, with overrides that change the experiment); "" for run folders."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """The overrides that make the runs tabulated those of a plan variant, not of the plan's own settings."""
    plan_files: list[Path] = field(default_factory=list)
    blocks: dict[str, str] = field(default_factory=dict)
    """Row -> its block in a table of several plans (`lenet5` of `lenet5: FedAvg`); rows not named have none."""
    notes: list[str] = field(default_factory=list)
    """What the plans' tuning stages chose (tuning.TunedGrid.table_notes)."""
    tuned: list[str] = field(default_factory=list)
    """The settings the plans tune (they differ between a plan's cells, never telling plans apart)."""
    choices: dict[tuple[str, str], str] = field(default_factory=dict)
    """(row, setting) -> the values its tuning stage chose (`client_optimizer.lr=0.2`), where one has."""
    tuning: str = ""
    """How the plans' tuning stages chose (`on seed 100, by the best val_accuracy`); "" without one."""

    def baselines(self, method: str) -> dict[str, str]:
        """Row -> the row its cells are compared with by `--baseline method`: the row of that name, or
        else, in a table of several plans, the row of that method in its own block. The baseline's own
        rows, and rows of a block without it, have none."""
        if method in self.methods:
            return {row: method for row in self.methods if row != method}
        of_block = {block: row for row, block in self.blocks.items() if row == f"{block}: {method}"}
        if not of_block:
            methods = sorted({row.removeprefix(f"{self.blocks[row]}: ") if row in self.blocks else row
                              for row in self.methods})
            raise ConfigError("baseline", f"a method of the table ({', '.join(methods)})", method)
        return {row: of_block[block] for row, block in self.blocks.items()
                if block in of_block and of_block[block] != row}

    def blocks_without(self, method: str) -> list[str]:
        """The blocks of rows of a table of several plans that have no row of `method` (their plan lacks
        it): `--baseline method` compares their rows with nothing."""
        if method in self.methods:
            return []
        having = {block for row, block in self.blocks.items() if row == f"{block}: {method}"}
        return [block for block in dict.fromkeys(self.blocks.values()) if block not in having]


def load_entries(plan: Union[str, list[str]], runs_root: Path, overrides: Optional[list[str]] = None) -> Loaded:
    if isinstance(plan, str) and Path(plan).is_file():
        return _from_plan(Path(plan), Path(runs_root), overrides)
    entries_given = [plan] if isinstance(plan, (str, Path)) else list(plan)
    if len(entries_given) > 1 and all(Path(entry).is_file() for entry in entries_given):
        return _from_plans([Path(entry) for entry in entries_given], Path(runs_root), overrides)
    if len(entries_given) == 1 and Path(entries_given[0]).is_file():
        return _from_plan(Path(entries_given[0]), Path(runs_root), overrides)
    if overrides:
        raise ConfigError("override", "a plan to apply it to (run folders are tabulated as they were run)",
                          overrides)
    paths = find_runs(entries_given, recursive=True)
    paths = [p for p in paths if (p / METRICS_FILE).is_file()]
    if not paths:
        raise ConfigError("plan", "a plan file, or run folders or a glob matching folders with metrics.jsonl",
                          plan)
    return _from_folders(paths)


def _from_plan(path: Path, runs_root: Path, overrides: Optional[list[str]] = None) -> Loaded:
    plan = load_plan(path, runs_root=runs_root, overrides=overrides)
    resolver = GridResolver()
    # Overrides are checked at every point, those without runs too, as a sweep of them checks them.
    plan = settle_variant(plan, resolver)
    tuned = TunedGrid(plan, resolver)  # a tuned method's runs with their setting's choice, or waiting
    grid = tuned.final_points
    settings = list(dict.fromkeys(point.setting_name for point in grid))
    axis_values = {axis: list(choices) for axis, choices in plan.settings.items()}
    labels = {point.setting_name: setting_label(point.setting, axis_values) for point in grid}
    reference = plan.reference
    if reference is not None and not reference.is_file() and (path.parent / reference).is_file():
        reference = path.parent / reference
    return Loaded(entries=[Entry(point.method, point.setting_name, point.seed, point.out_dir, point, path, resolver)
                            for point in grid],
                   methods=list(plan.methods), settings=settings, labels=labels, metric=plan.metric,
                   reference=reference, out=plan.runs_root / plan.name, plan_file=path, name=plan.name,
                   overrides=plan.variant_overrides, plan_files=[path], notes=tuned.table_notes(),
                   tuned=[key for grid in (plan.tune.methods.values() if plan.tune else []) for key in grid],
                   choices={(method, setting): describe_candidate(selection.chosen)
                            for (setting, method), selection in tuned.made.items()},
                   tuning="" if plan.tune is None else (f"on seed{'s' * (len(plan.tune.seeds) > 1)} "
                                                        f"{', '.join(map(str, plan.tune.seeds))}, by the best "
                                                        f"{plan.tune.select}"))


def _from_plans(paths: list[Path], runs_root: Path, overrides: Optional[list[str]]) -> Loaded:
    """Several plans as one table, the paper's table that they split (FedCONST's Table 1: a plan per
    model and federation). Columns are the plans' settings in the order the plans are given, each
    once; rows are their methods in that order. Plans that share a column (a setting name) are told
    apart by the settings that differ between them (`model.name` for FedCONST: lenet5, resnet18):
    each of their rows is prefixed with its values (`lenet5: FedAvg`; a number with its setting's
    name, `hidden=16: FedAvg`), so the table has a block of
    rows per value; plans without a shared column add columns to the same rows. A cell that two
    plans would fill is refused. Each plan's reference gives the numbers of its own cells."""
    parts = [_from_plan(path, runs_root, overrides) for path in paths]
    metrics = {str(part.plan_file): part.metric for part in parts}
    if len(set(metrics.values())) > 1:
        raise ConfigError("plan", "plans that report one metric (their `metric:`), to be one table", metrics)
    blocks = _row_blocks(parts)
    entries, methods, settings, owner, row_blocks = [], [], [], {}, {}
    papers: dict[tuple[str, str], Optional[float]] = {}
    row_of = []
    for part, block in zip(parts, blocks):
        rows = {method: f"{block}: {method}" if block else method for method in part.methods}
        row_of.append(rows)
        row_blocks.update({row: block for row in rows.values() if block})
        for row, setting in itertools.product(rows.values(), part.settings):
            if (row, setting) in owner:
                raise ConfigError("plan", "plans that fill each cell of the table once", f"{row} | {setting} in "
                                  f"{owner[row, setting]} and {part.plan_file}")
            owner[row, setting] = part.plan_file
        methods += [row for row in rows.values() if row not in methods]
        settings += [setting for setting in part.settings if setting not in settings]
        entries += [dataclasses.replace(entry, method=rows[entry.method]) for entry in part.entries]
        if part.reference is not None:
            numbers = paper_numbers(part.reference, part.methods, part.settings, part.labels)
            papers.update({(rows[method], setting): number for (method, setting), number in numbers.items()})
    parsed = {setting: _parse_setting_name(setting) or {} for setting in settings}
    axis_values: dict[str, list[str]] = {}
    for setting in parsed.values():
        for axis, value in setting.items():
            axis_values.setdefault(axis, []).append(value)
    labels = {setting: setting_label(parsed[setting], axis_values) for setting in settings}
    names = [part.out.name for part in parts]
    digest = hashlib.sha256("+".join(names).encode()).hexdigest()[:8]
    prefix = os.path.commonprefix(names).rstrip("_-.@") or "plans"
    name = f"{prefix}+{len(parts)}plans-{digest}"
    return Loaded(entries=entries, methods=methods, settings=settings, labels=labels, metric=parts[0].metric,
                   reference=None, out=Path(runs_root) / name, name=name, blocks=row_blocks,
                   overrides={key: value for part in parts for key, value in part.overrides.items()},
                   plan_files=paths, papers=papers if any(part.reference is not None for part in parts) else None,
                   notes=[note for part in parts for note in part.notes],
                   choices={(rows[method], setting): chosen for part, rows in zip(parts, row_of)
                            for (method, setting), chosen in part.choices.items()},
                   tuning="; ".join(dict.fromkeys(part.tuning for part in parts if part.tuning)))


def _row_blocks(parts: list[Loaded]) -> list[str]:
    """Per plan, what tells its rows apart from those of the plans that share a column with it: the
    values of the settings that every run of each of two such plans has, and that differ between
    them (`hidden=16`, `lenet5`), or "". Never a method's own settings (the algorithm and what varies
    between a plan's rows or columns: the row's method already names them), a setting one of the two
    lacks, nor a point's seed (plans that differ in their seeds alone fill the same cells)."""
    tuned = [key for part in parts for key in part.tuned]
    shared_by_all, varying = [], set()
    for part in parts:
        flat = [{name: value for name, value in defining_settings(entry.config).items()
                 if name not in SET_BY_THE_PLAN and not any(same_setting(name, key) for key in tuned)}
                for entry in part.entries]
        shared = {name: value for name, value in flat[0].items()
                  if all(name in other and other[name] == value for other in flat[1:])}
        varying |= {name for settings in flat for name in settings if name not in shared}
        shared_by_all.append(shared)
    telling = set()
    for first, second in itertools.combinations(range(len(parts)), 2):
        if set(parts[first].settings) & set(parts[second].settings):
            a, b = shared_by_all[first], shared_by_all[second]
            telling |= {name for name in a.keys() & b.keys() if a[name] != b[name] and name not in varying
                        and name.split(".")[0] != "algorithm"}
    return [", ".join(_block_value(name, block[name]) for name in sorted(telling)) for block in shared_by_all]


def _block_value(name: str, value) -> str:
    """`lenet5` (a name says what it is; of a dotted path, its last part: `make_net` of `my_model.make_net`),
    `hidden=16` (a number does not)."""
    if isinstance(value, str):
        return value.rsplit(".", 1)[-1] if _DOTTED_PATH.fullmatch(value) else value
    return f"{name.rsplit('.', 1)[-1]}={value_text(value)}"


_DOTTED_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


_SEED = re.compile(r"seed(\d+)")


def _from_folders(paths: list[Path]) -> Loaded:
    entries = []
    for path in paths:
        seed = _SEED.fullmatch(path.name)
        if seed and path.parent.name and path.parent.parent.name:
            entries.append(Entry(path.parent.name, path.parent.parent.name, int(seed.group(1)), path))
        else:
            entries.append(Entry(path.name, "", int(RunFolder(path).config.get("seed") or 0), path))
    _check_one_run_per_seed(entries)
    settings = list(dict.fromkeys(e.setting for e in entries))
    parsed = {s: _parse_setting_name(s) for s in settings}
    axis_values: dict[str, list[str]] = {}
    for setting in parsed.values():
        for axis, value in (setting or {}).items():
            axis_values.setdefault(axis, []).append(value)
    labels = {s: (setting_label(parsed[s], axis_values) if parsed[s] else s or "runs") for s in settings}
    common = Path(os.path.commonpath([str(p.resolve()) for p in paths]))
    out = common.parent if (common / METRICS_FILE).is_file() else common
    return Loaded(entries=entries, methods=list(dict.fromkeys(e.method for e in entries)), settings=settings,
                   labels=labels, metric=TEST_ACCURACY, reference=None, out=out)


def _check_one_run_per_seed(entries: list[Entry]) -> None:
    """Two folders of one row, column and seed would be counted as two seeds (and pair with one
    baseline run): refused, naming both."""
    seen: dict[tuple[str, str, int], Path] = {}
    for entry in entries:
        key = (entry.method, entry.setting, entry.seed)
        if key in seen:
            raise ConfigError("plan", "run folders of one run per method, setting and seed (two runs of one seed "
                              "are not two seeds)", f"{seen[key]} and {entry.path}, both {_describe(entry)}")
        seen[key] = entry.path


def _describe(entry: Entry) -> str:
    return " | ".join(filter(None, [entry.method, entry.setting, f"seed {entry.seed}"]))


def _parse_setting_name(name: str) -> Optional[dict[str, str]]:
    """"dataset-cifar10_alpha-0.5" -> {dataset: cifar10, alpha: 0.5}; None when not of that form."""
    setting = {}
    for part in name.split("_"):
        axis, dash, value = part.partition("-")
        if not dash or not axis or not value:
            return None
        setting[axis] = value
    return setting or None


def describe_setting(configs: list[dict]) -> str:
    """What every run of `configs` shares of the setting a paper states: `LeNet-5 on CIFAR-10, N = 100
    clients, S = 10 per round, K = 50 local steps (or E = 1 local epochs), 300 rounds`. What differs
    between them (a column's dataset, a block's model) is left out: the labels say it; "" for none."""
    flat = [flatten(config) for config in configs]

    def shared(key: str):
        values = [settings.get(key) for settings in flat]
        return values[0] if values and values[0] is not None and all(v == values[0] for v in values) else None

    model, dataset = shared("model.name"), shared("data.name")
    model = None if model is None else model_label(_block_value("model.name", model))
    dataset = None if dataset is None else dataset_label(_block_value("data.name", dataset))
    parts = [" on ".join(filter(None, [model, dataset]))] if model or dataset else []
    steps, epochs = shared("federation.local_steps"), shared("federation.local_epochs")
    for value, text in ((shared("federation.num_clients"), "N = {} clients"),
                        (shared("federation.clients_per_round"), "S = {} per round"),
                        (steps, "K = {} local steps"), (None if steps else epochs, "E = {} local epochs"),
                        (shared("federation.rounds"), "{} rounds")):
        if value is not None:
            parts.append(text.format(value_text(value)))
    return ", ".join(parts)


AXIS_SYMBOLS = {"alpha": "α", "dirichlet": "α", "beta": "β", "gamma": "γ", "mu": "μ", "rho": "ρ"}


def setting_label(setting: dict[str, str], axis_values: dict[str, list[str]]) -> str:
    """A column label from a setting's axis values; an axis with a single value everywhere is left
    out (unless every axis is)."""
    varying = {a: v for a, v in setting.items() if len(set(axis_values.get(a, []))) > 1} or setting
    if not varying:
        return "default"
    parts = []
    for axis, value in varying.items():
        if axis.lower() in ("dataset", "data"):
            parts.append(dataset_label(value))
        else:
            parts.append(f"{AXIS_SYMBOLS.get(axis.lower(), axis)} = {value}")
    return ", ".join(parts)
