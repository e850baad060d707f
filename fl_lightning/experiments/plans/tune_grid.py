"""A plan's `tune:` block as read (`TuneGrid`, one field a key): per tuned method a small grid of its own
settings, its candidates and their names. The rule that chooses among them is tuning.py."""

from __future__ import annotations

import itertools
import re
from dataclasses import MISSING, dataclass, fields
from typing import Any, Optional

from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.overrides import SET_BY_THE_PLAN, SET_BY_THE_SWEEP, value_text
from fl_lightning.experiments.runs import AT_CHOICES, parse_at
from fl_lightning.run_dir import flatten

CHOOSE_FROM = ("all", "finished")
_CANDIDATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9+=._-]*")


@dataclass(frozen=True)
class TuneGrid:
    """A plan's `tune:`: per tuned method, a small grid of its own settings, whose every candidate (one
    value of each) runs on the tuning seeds; tuning.py chooses one per setting by `select` at `at`."""

    seeds: list[int]
    select: str
    methods: dict[str, dict[str, list]]
    """Method -> dotted setting -> its values, in the plan's order."""
    at: str = "final"
    choose_from: str = "all"
    """`all`: a choice waits for every tuning run of its cell to finish (or fail in the sweep that ran
    it); `finished`: a stage that ended with runs unfinished (cancelled) chooses from the others."""

    def candidates(self, method: str) -> list[dict[str, Any]]:
        """The method's candidates in the plan's order (the product of its settings' values, the last
        setting varying fastest); [] for a method not tuned."""
        return _product(self.methods.get(method) or {})


def _product(grid: dict[str, list]) -> list[dict[str, Any]]:
    """{a: [1, 2], b: [3]} -> [{a: 1, b: 3}, {a: 2, b: 3}]; [] for {}."""
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())] if grid else []


def candidate_name(candidate: dict[str, Any]) -> str:
    """A candidate's folder name: `lr=0.03`, `lr=0.03+momentum=0.9`; a setting's full dotted name
    where two of its settings end alike (`client_optimizer.lr=0.1+server_optimizer.lr=0.5`)."""
    ends = [key.rsplit(".", 1)[-1] for key in candidate]
    names = ends if len(set(ends)) == len(ends) else [key.replace(".init_args.", ".") for key in candidate]
    return "+".join(f"{name}={value_text(value)}" for name, value in zip(names, candidate.values()))


def describe_candidate(candidate: dict[str, Any]) -> str:
    """`client_optimizer.lr=0.03, client_optimizer.momentum=0.9`."""
    return ", ".join(f"{key}={value_text(value)}" for key, value in candidate.items())


def check_seeds(key: str, seeds) -> None:
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise ConfigError(key, "a non-empty list of integers >= 0", seeds)
    if len(set(seeds)) != len(seeds):
        raise ConfigError(key, "distinct seeds (a seed given twice is one run folder, counted twice in the table)",
                          seeds)


def read_tune(tune, raw: dict) -> Optional[TuneGrid]:
    """A plan's `tune:` checked (its methods' grids against `raw`, the plan read so far); None without one."""
    if tune is None:
        return None
    defaults = {key.name: key.default for key in fields(TuneGrid) if key.default is not MISSING}
    required = [key.name for key in fields(TuneGrid) if key.name not in defaults]
    if not isinstance(tune, dict) or set(tune) - {*required, *defaults}:
        raise ConfigError("plan.tune", f"a mapping of {', '.join(required)} and optionally {' and '.join(defaults)}",
                          tune)
    seeds, plan_seeds = tune.get("seeds"), raw.get("seeds", [0])
    check_seeds("plan.tune.seeds", seeds)
    if set(seeds) & set(plan_seeds):
        raise ConfigError("plan.tune.seeds", f"seeds apart from the plan's seeds {plan_seeds} (a run the choice was "
                          "made on would be reported as one of the plan's runs)", seeds)
    select, at = tune.get("select"), tune.get("at", defaults["at"])
    if not isinstance(select, str) or not select:
        raise ConfigError("plan.tune.select", "the validation metric the choice is made by (val_accuracy, val_loss)",
                          select)
    try:
        parse_at(at)
    except ConfigError as err:
        raise ConfigError("plan.tune.at", AT_CHOICES, at) from err
    choose_from = tune.get("choose_from", defaults["choose_from"])
    if choose_from not in CHOOSE_FROM:
        raise ConfigError("plan.tune.choose_from", f"one of {', '.join(CHOOSE_FROM)} (every candidate's runs finished, "
                          "or a stage cut short chooses from the finished ones)", choose_from)
    methods = tune.get("methods")
    if not isinstance(methods, dict) or not methods:
        raise ConfigError("plan.tune.methods", "a mapping of method -> {dotted setting: [values]}", methods)
    for method, grid in methods.items():
        _check_tuned(f"plan.tune.methods.{method}", method, grid, raw)
    return TuneGrid(seeds=seeds, select=select, at=at, methods=methods, choose_from=choose_from)


def _check_tuned(key: str, method, grid, raw: dict) -> None:
    if method not in raw["methods"]:
        raise ConfigError("plan.tune.methods", f"methods of the plan ({', '.join(map(str, raw['methods']))})", method)
    if not isinstance(grid, dict) or not grid or not all(isinstance(values, list) and values
                                                         for values in grid.values()):
        raise ConfigError(key, "a mapping of dotted setting -> a non-empty list of its values", grid)
    for setting in grid:
        if not isinstance(setting, str) or setting in SET_BY_THE_PLAN or setting in SET_BY_THE_SWEEP:
            raise ConfigError(key, f"dotted fit settings other than {', '.join(SET_BY_THE_PLAN + SET_BY_THE_SWEEP)}",
                              setting)
        for axis, choices in (raw.get("settings") or {}).items():
            if any(isinstance(part, dict) and same_setting(setting, name)
                   for parts in choices.values() for part in parts for name in flatten(part)):
                raise ConfigError(key, f"settings that no setting axis sets ({setting} is set by settings.{axis}: "
                                  "its columns would each train the candidates instead)", setting)
    candidates = _product(grid)
    names = {candidate_name(candidate) for candidate in candidates}
    if len(names) != len(candidates) or not all(map(_CANDIDATE_NAME.fullmatch, names)):
        raise ConfigError(key, "values that name distinct folders (numbers, names: letters, digits and + = . _ -)",
                          grid)


def same_setting(a: str, b: str) -> bool:
    """Whether dotted settings `a` and `b` are one, or one is part of the other; `init_args.` is left
    out, as the command line lets it be."""
    a, b = (name.replace(".init_args.", ".") for name in (a, b))
    return a == b or a.startswith(f"{b}.") or b.startswith(f"{a}.")
