"""`--override KEY=VALUE` of `fl-lightning sweep`, `table` and `dashboard`: a shipped plan scaled down
or pointed elsewhere from the command line, without copying it.

    fl-lightning sweep configs/plans/ctpfl_table1.yaml --override federation.rounds=20 \
        --override data.root=/scratch/data

Each override is a dotted `fit` setting and a YAML value (`20`, `0.1`, `/scratch/data`, `[1, 2]`),
applied last to every grid point: after the plan's configs, the setting's and the method's parts,
and the seed.

An override that changes the experiment moves the plan's runs into a variant of their own,
`<plan>@<hint>-<digest>` (`ctpfl_table1@rounds20-1c0ffee5`): its own run folders
runs/<variant>/..., its own W&B tag `plan=<variant>` and groups, its own table. The digest (8 hex
digits of the experiment-changing overrides) tells variants apart; the hint (each key's last part
and its value) is there to be read, and left out when it would not be a short, folder-safe name
(or would make the W&B tag longer than W&B takes).
So a scaled-down grid never shares a folder, a table or a W&B group with the full one. The settings
that `fit` lets change on resume (fl_lightning.run_dir.SAFE_TO_CHANGE: data.root, logging,
checkpoints, compute, ...) keep the plan's name and folders, except `federation.rounds`: more rounds
continue a run, but a table reports the accuracy at the plan's rounds, so other rounds are another
table.

An override that restates what every grid point already has (`federation.rounds=3` of a 3-round
plan, `data.validation=0`) names no variant: the plan's own runs are swept and tabulated
(`fl_lightning.experiments.plans.resolve.settle_variant`, decided from every point's resolved settings).
A variant's table says so in its caption, table.csv and plot, and its folder holds `variant.yaml`:
the plan file and the overrides that make it.

An override of a setting that a setting axis or a method sets (every column or row would train its
value under its own label), or one that `fit` refuses at a point, is refused by sweep, table and
dashboard alike: `fl_lightning.experiments.plans.resolve.check_overrides`.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path
from typing import Any, Optional

import yaml

from fl_lightning.atomic_files import write_text_atomically
from fl_lightning.errors import ConfigError
from fl_lightning.run_dir import is_safe_to_change
from fl_lightning.yaml_text import load_yaml

ROUNDS = "federation.rounds"
"""Safe to change on resume, yet another table: it always makes a variant."""
SET_BY_THE_PLAN = ("seed", "out_dir", "resume", "overwrite", "logger.group", "logger.name", "logger.tags")
"""Settings each grid point gets from the plan (its seed, folder and W&B names), never overridden."""
SET_BY_THE_SWEEP = ("fabric.accelerator", "fabric.devices", "fabric.num_nodes")
"""Given to each run by the sweep from --gpus_per_run (or by a SLURM task from its allocation)."""
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_HINT = re.compile(r"[A-Za-z0-9._+-]+")
HINT_LENGTH = 32
TAG_LENGTH = 64
"""W&B refuses longer tags; each run of a variant is tagged plan=<variant>."""


def parse_overrides(overrides: Optional[list[str]]) -> dict[str, Any]:
    """["federation.rounds=20", "data.root=/scratch"] -> {"federation.rounds": 20, "data.root": "/scratch"};
    each refused, naming it, unless it is KEY=VALUE with a dotted setting the plan leaves to it."""
    parsed: dict[str, Any] = {}
    for override in overrides or []:
        key, equals, text = str(override).partition("=")
        key = key.strip()
        if not equals or not _KEY.fullmatch(key):
            raise ConfigError("override", "KEY=VALUE with a dotted fit setting (federation.rounds=20)", override)
        if key in SET_BY_THE_PLAN:
            raise ConfigError("override", f"a setting other than {', '.join(SET_BY_THE_PLAN)} (each grid point "
                              "gets these from the plan)", override)
        if key in SET_BY_THE_SWEEP:
            raise ConfigError("override", f"a setting other than {', '.join(SET_BY_THE_SWEEP)} (the sweep gives "
                              "each run its devices: --gpus_per_run)", override)
        if key in parsed:
            raise ConfigError("override", "each setting once", key)
        try:
            parsed[key] = load_yaml(text)
        except yaml.YAMLError as err:
            raise ConfigError("override", "a YAML value after KEY=", f"{override} ({err})") from err
    return parsed


def changes_the_experiment(key: str) -> bool:
    return key == ROUNDS or not is_safe_to_change(key)


def variant_name(plan_name: str, overrides: dict[str, Any]) -> str:
    """The plan's name when no override changes the experiment, else `<plan>@<hint>-<digest>`."""
    defining = {key: value for key, value in sorted(overrides.items()) if changes_the_experiment(key)}
    if not defining:
        return plan_name
    digest = hashlib.sha256(json.dumps(defining, sort_keys=True, default=str).encode()).hexdigest()[:8]
    hint = "+".join(f"{key.rsplit('.', 1)[-1]}{value_text(value)}" for key, value in defining.items())
    named = f"{plan_name}@{hint}-{digest}"
    if len(hint) > HINT_LENGTH or not _HINT.fullmatch(hint) or len(f"plan={named}") > TAG_LENGTH:
        return f"{plan_name}@{digest}"
    return named


def value_text(value: Any) -> str:
    """A value as a grid point's command line gives it to `fit` (`20`, `0.1`, `[1, 2]`)."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def describe_overrides(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value_text(value)}" for key, value in overrides.items())


VARIANT_FILE = "variant.yaml"


def write_variant_file(folder: Path, variant: str, plan_files: list[Path], overrides: dict[str, Any]) -> Path:
    """`folder`/variant.yaml: which plan file(s) and which overrides make the variant whose runs (or
    table) the folder holds, and the sweep command that trains them."""
    sweeps = [shlex.join(["fl-lightning", "sweep", str(path), *(f"--override={key}={value_text(value)}"
                                                               for key, value in overrides.items())])
              for path in plan_files]
    text = ("# A plan variant: the plan's grid with these overrides applied last to every point (--override),\n"
            "# not the plan's own settings.\n"
            + yaml.safe_dump({"variant": variant, "plan_files": [str(path) for path in plan_files],
                              "overrides": overrides, "sweep": sweeps}, sort_keys=False, allow_unicode=True))
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomically(folder / VARIANT_FILE, text)
    return folder / VARIANT_FILE
