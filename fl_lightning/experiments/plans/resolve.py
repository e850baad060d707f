"""Each grid point's `fit` settings, resolved in this process as `fit` resolves its own, without training.

A point's command line (`GridPoint.fit_arguments`) is parsed by the command line's one parse function
(through `GridPointParser`: a setting and method's seeds after the first are parsed as that one's
settings with their own seed, run folder and name), instantiated, and turned into the run's config by
`fl_lightning.fit.fit_config_of`: the same checks as `fit` (types and values of every field, the
algorithm's own arguments, the federation), and the same config dict that `fit` records in
config.yaml and its checkpoints, so that a run folder can be
compared with the point it belongs to (`fl_lightning.run_dir.check_same_experiment`). The devices are
not checked here: a sweep gives each run its own, and an array task gets its allocation's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import yaml

from fl_lightning.cli.parser import CommandParser, GridPointParser, build_parser
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.overrides import describe_overrides
from fl_lightning.experiments.runs import RunFolder, RunState
from fl_lightning.fit import fit_config_of, unused_settings
from fl_lightning.run_dir import flatten
from fl_lightning.yaml_text import load_yaml

if TYPE_CHECKING:
    from fl_lightning.experiments.plans.plan import GridPoint, Part, Plan


@dataclass
class ResolvedPoint:
    point: GridPoint
    config: Optional[dict]
    """The config dict `fit` builds for this point; None when its settings are refused."""
    settings: Any = None
    """The parsed, not instantiated, settings of the `fl-lightning` command line (for dumping them)."""
    error: Optional[ConfigError] = None
    unused: dict[str, str] = dataclasses.field(default_factory=dict)
    """The groups of `config` that the run never reads, each with why (fit.unused_settings)."""

    @property
    def rounds(self) -> Optional[int]:
        return None if self.config is None else self.config["federation"]["rounds"]


@functools.cache
def fit_parser() -> CommandParser:
    """`fit`'s parser, built once in a process: building it takes longer than parsing a grid point, and
    one parser parses any number of command lines (a sweep parses all its points with one)."""
    return build_parser()


class GridResolver:
    """Grid points resolved one at a time, as they are asked for, by one GridPointParser: a point of a
    setting and method whose first seed it has parsed is parsed from that one's settings. What a
    command line resolves to is kept by the line, each line resolved once; the point it is given with
    is the one asked about (a tuned method's run waiting for its choice and the same run once its
    choice is made share a command line, not their state)."""

    def __init__(self):
        self._parser = fit_parser()
        self._grid_parser = GridPointParser(self._parser)
        self._resolved: dict[tuple[str, ...], ResolvedPoint] = {}

    def resolve(self, point: GridPoint) -> ResolvedPoint:
        """The point resolved; when `fit` would refuse its settings, holding the error."""
        argv = tuple(point.fit_arguments())
        if argv not in self._resolved:
            self._resolved[argv] = self._resolve(point, list(argv))
        return dataclasses.replace(self._resolved[argv], point=point)

    def _resolve(self, point: GridPoint, argv: list[str]) -> ResolvedPoint:
        try:
            settings = self._grid_parser.parse(argv)
            arguments = self._parser.instantiate(settings).fit
            arguments.pop("config", None)
            checked = fit_config_of(arguments)
            unused = unused_settings(type(checked.settings.algorithm))
            return ResolvedPoint(point, checked.config, settings, unused=unused)
        except ConfigError as err:
            return ResolvedPoint(point, None, error=err)


def resolve_grid(points: list[GridPoint]) -> list[ResolvedPoint]:
    """Every point resolved; a point whose settings `fit` would refuse holds its error."""
    resolver = GridResolver()
    return [resolver.resolve(point) for point in points]


class PlanRefused(ConfigError):
    """A plan refused for what several of its grid points hold, one line each."""

    def __init__(self, field_name: str, expected: str, plan: Path, problems: list[str]):
        listed = "\n".join(f"  {problem}" for problem in problems)
        ValueError.__init__(self, f"{field_name}: expected {expected}, got {plan}, where\n{listed}")
        self.field_name = field_name


def describe_point(point: GridPoint) -> str:
    return f"{point.label} | {point.setting_name} | seed {point.seed}"


def check_grid(plan: Path, resolved: list[ResolvedPoint]) -> None:
    """Refuse a plan any of whose points `fit` would refuse, naming each such point and its field."""
    broken = [entry for entry in resolved if entry.error is not None]
    if broken:
        raise PlanRefused("plan", f"grid points whose settings fit accepts (every point is checked before any "
                          f"run starts; {len(broken)} of {len(resolved)} are refused)", plan,
                          [refusal(entry) for entry in broken])


def read_states(resolved: list[ResolvedPoint]) -> dict[int, RunState]:
    """index -> what the point's run folder holds (trains nothing)."""
    return {entry.point.index: RunFolder(entry.point.out_dir).state(entry.rounds) for entry in resolved}


def check_folders(plan: Path, resolved: list[ResolvedPoint], states: dict[int, RunState]) -> None:
    """Refuse to run a plan any of whose run folders holds another experiment than its point's, listing each."""
    problems = []
    for entry in resolved:
        point = entry.point
        different = RunFolder(point.out_dir).difference(entry.config, states[point.index])
        if different is not None:
            problems.append(f"[{point.index}] {describe_point(point)} in {point.out_dir}: {different}")
    if problems:
        raise PlanRefused("out_dir", f"run folders that hold this plan's experiments or nothing ({len(problems)} hold "
                          "runs made with other settings: move each away, or give the plan its settings back, "
                          "then run the same command again)", plan, problems)


def settle_variant(plan: Plan, resolver: Optional[GridResolver] = None) -> Plan:
    """The plan named for the overrides that change a point, once they are checked (check_overrides, which
    resolves every point of the named plan with `resolver`): how `sweep`, `table` and `dashboard` begin a
    plan given with `--override`.

    An override that restates, at every point, what the point resolves to without the overrides
    (`federation.rounds=3` of a 3-round plan; `data.validation=0`, which `fit` reads as null) changes
    no run: it names no variant, so the plan's own runs are the ones swept and tabulated. Which do is
    decided on the first seed's points before the plan is named: the seeds of a setting and method differ
    in their seed alone, and what a point resolves to does not depend on the folder it is named into."""
    if not plan.overrides:
        return plan
    own, named_after = GridResolver(), GridResolver()
    pairs = [(named_after.resolve(point), own.resolve(dataclasses.replace(point, overrides={})))
             for point in plan.grid() if point.seed == plan.seeds[0]]
    restated = frozenset(key for key in plan.overrides
                         if all(entry.config is not None and plain.config is not None
                                and value_of(entry.config, key) == value_of(plain.config, key)
                                for entry, plain in pairs))
    settled = plan.restating(restated)
    resolver = resolver or GridResolver()
    check_overrides(settled, [resolver.resolve(point) for point in settled.grid()], own)
    return settled


def check_overrides(plan: Plan, resolved: list[ResolvedPoint], own: Optional[GridResolver] = None) -> None:
    """Refuse the plan's overrides (`--override`, applied last to every point) where a table, a
    dashboard or the runs of the variant would belong to no experiment of the plan; `resolved` holds
    every point, resolved with them, and `own` resolves points without them. Overrides that restate
    what every point has (Plan.restated) are not refused. Refused, in `sweep`, `table` and `dashboard` alike:

    - an override of a setting that a setting axis or a method sets: every column (or row) would
      train the override's value under the label of its own. An axis or a method sets it when its
      mappings name it, or when the points' own settings (every config fragment resolved) differ in
      it between the axis's values or between the methods; so is one of a tuned setting (the plan's
      `tune.methods`), whose every candidate would train the override's value;
    - an override that `fit` refuses (an unknown key, a bad value) at a point whose own settings it
      accepts: the variant's runs could never be trained, and a table of them would show none."""
    if not plan.overrides:
        return
    own = own or GridResolver()

    def without_overrides(point: GridPoint) -> ResolvedPoint:
        return own.resolve(dataclasses.replace(point, overrides={}))

    first_seed = [without_overrides(entry.point) for entry in resolved if entry.point.seed == plan.seeds[0]]
    collisions = {key: setters for key in plan.overrides
                  if key not in plan.restated and (setters := _set_by(plan, key, first_seed))}
    if collisions:
        reasons = "; ".join(f"{key} is set by {' and by '.join(setters)}" for key, setters in collisions.items())
        raise ConfigError("override", f"settings that no setting axis or method of the plan sets ({reasons}: each "
                          "column or row would train the override's value under its own label; change the plan, "
                          "or a copy of it, instead)",
                          describe_overrides({key: plan.overrides[key] for key in collisions}))
    refused = [entry for entry in resolved if entry.error is not None and without_overrides(entry.point).error is None]
    if refused:
        raise PlanRefused("override", f"settings that fit accepts at every grid point ({len(refused)} of "
                          f"{len(resolved)} points are refused with the overrides and accepted without them)",
                          plan.path, [refusal(entry) for entry in refused])


def _set_by(plan: Plan, key: str, points: list[ResolvedPoint]) -> list[str]:
    """What in the plan sets `key`: `settings.<axis>`, `methods <names>`, or `tune.methods <names>`
    (a tuned setting, or a group holding one); `points` hold one seed of every setting and method,
    resolved without the overrides."""
    setters = []
    for axis, choices in plan.settings.items():
        def rest_of_point(point: GridPoint, axis=axis) -> Hashable:
            return point.method, tuple((other, value) for other, value in point.setting.items() if other != axis)

        if any(_names(parts, key) for parts in choices.values()) or _differing_group(points, key, rest_of_point):
            setters.append(f"settings.{axis}")
    methods = [method for method, parts in plan.methods.items() if _names(parts, key)] or [
        entry.point.method for entry in _differing_group(points, key, lambda point: point.setting_name)
        if value_of(entry.config, key)]
    if methods:
        setters.append(f"method{'s' if len(methods) > 1 else ''} {', '.join(methods)}")
    tuned = [method for method, grid in (plan.tune.methods if plan.tune else {}).items()
             if any(_under(name, key) or _under(key, name) for name in grid)]
    if tuned:
        setters.append(f"tune.methods {', '.join(tuned)}")
    return setters


def _spellings(key: str) -> set[str]:
    """A dotted setting as the command line takes it: `algorithm.span` is `algorithm.init_args.span`."""
    group, _, rest = key.partition(".")
    return {key, f"{group}.init_args.{rest}"} if rest else {key}


def _under(name: str, key: str) -> bool:
    """`name` is the setting `key` or one of its parts (`federation.rounds` is under `federation`)."""
    return any(a == b or a.startswith(f"{b}.") for a in _spellings(name) for b in _spellings(key))


def _names(parts: list[Part], key: str) -> bool:
    """Whether a mapping among `parts` sets `key` or a part of it (one that chooses the algorithm, or
    gives a group as a file, shows in the points' settings instead)."""
    return any(_under(name, key) for part in parts if isinstance(part, dict) for name in flatten(part))


def value_of(config: dict, key: str) -> tuple:
    """What `config` holds of `key`: its value, or those of the settings under it; () when it has none."""
    return tuple(sorted((name, repr(value)) for name, value in flatten(config).items() if _under(name, key)))


def _differing_group(points: list[ResolvedPoint], key: str, group_of: Callable[[GridPoint], Hashable]
                     ) -> list[ResolvedPoint]:
    """The points of the first group (by `group_of`) whose settings differ in `key`; [] when every
    group's agree. Points that `fit` refuses are left out."""
    groups: dict[Hashable, list[ResolvedPoint]] = {}
    for entry in points:
        if entry.config is not None:
            groups.setdefault(group_of(entry.point), []).append(entry)
    return next((group for group in groups.values() if len({value_of(entry.config, key) for entry in group}) > 1), [])


def accepted_config(plan: Path, resolved: ResolvedPoint) -> dict:
    """The point's config, for a table or a compare of a run of it; when `fit` refuses the point's
    settings, the plan is refused, naming the point and the field."""
    if resolved.error is not None:
        raise PlanRefused("plan", "grid points whose settings fit accepts", plan, [refusal(resolved)])
    return resolved.config


def refusal(entry: ResolvedPoint) -> str:
    """What `fit` refuses in a point's settings, and which point it is."""
    return f"[{entry.point.index}] {describe_point(entry.point)}: {entry.error}"


def fit_settings_text(resolved: ResolvedPoint) -> str:
    """The point's `fit` settings, every config fragment and override resolved, as YAML that
    `fl-lightning fit --config` reads back."""
    dumped = load_yaml(fit_parser().dump(resolved.settings))["fit"]
    return yaml.safe_dump(dumped, sort_keys=False)
