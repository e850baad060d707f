"""The run folder: one experiment per out_dir, held by one run at a time.

A folder belongs to the experiment that first wrote it. Resuming compares the settings that
define the experiment (algorithm and its arguments, model, data and split, federation, optimizers,
constraint, seed, precision) with those the folder's checkpoint (or config.yaml) recorded, before
anything is written, and refuses any change: a run that silently continued under other settings
would report numbers that belong to no experiment. Settings that only change how the run is
carried out (more rounds, evaluation and checkpoint cadence, logging, devices) may change, and so
may the callbacks but for the arguments of those the run had: each callback class names those of
its arguments a resume may change (`Callback.safe_to_change`: a time budget, a diagnostic's
cadence), any other (EarlyStopping's patience) is refused as the settings are.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional

import yaml

from fl_lightning.configurable import resolve_dotted_path
from fl_lightning.errors import ConfigError
from fl_lightning.file_lock import FileLock, LockHeld
from fl_lightning.yaml_text import load_yaml

CONFIG_FILE = "config.yaml"
VALIDATION_FILE = "validation.json"
PARTITION_PLOT = "partition.png"
LOCK_FILE = ".lock"
# What a run writes into its folder; `overwrite` removes exactly these.
RUN_FILES = (CONFIG_FILE, "metrics.jsonl", "partition.json", VALIDATION_FILE, PARTITION_PLOT, "participation.png",
             "checkpoints", "wandb")
# Dotted settings (or prefixes ending in ".") that change how a run is carried out, not its result.
SAFE_TO_CHANGE = (
    "federation.rounds", "federation.eval_every", "federation.eval_batch_size",
    "fabric.accelerator", "fabric.devices", "fabric.num_nodes", "fabric.strategy", "fabric.process_group_timeout_s",
    "data.root", "data.download", "data.per_client_eval", "compute.", "logger.", "checkpoint.", "callbacks", "out_dir",
    "resume", "overwrite",
)

# Settings that no longer exist and never changed a run's result: a run that recorded one continues.
RETIRED_SETTINGS = (
    "algorithm.init_args.vectorise",  # CTP-FL's choice of how to compute its gradients, now compute.client_path
)

# Settings added after runs were recorded, each with the value that reproduces those runs: a recorded
# config that lacks one was made with that value, and the digest leaves it out at that value, so such
# runs resume and keep their default folders.
ADDED_SETTINGS = {"data.validation": None, "data.per_client_eval": False,
                  "federation.participation": None, "federation.dropout": 0.0, "federation.stragglers": None}

# Classes renamed after runs were recorded: the class path a run records now -> the one runs recorded
# before (which still resolves, to the same class). Both name one experiment: the digest (a default run
# folder, a W&B group) and the comparison of a resume or a sweep read a class path as first recorded.
RENAMED_CLASS_PATHS = {
    "fl_lightning.algorithms.fedavg_client_momentum.FedAvgClientMomentum":
        "fl_lightning.algorithms.fedavg_m.FedAvgMomentum",
    "fl_lightning.algorithms.fedavg_server_momentum.FedAvgServerMomentum": "fl_lightning.algorithms.fedavgm.FedAvgM",
}


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    flat: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def is_safe_to_change(name: str) -> bool:
    return any(name == safe or (safe.endswith(".") and name.startswith(safe)) for safe in SAFE_TO_CHANGE)


def as_first_recorded(flat: dict[str, object]) -> dict[str, object]:
    """Flat settings with each class path of a renamed class as runs first recorded it."""
    return {name: RENAMED_CLASS_PATHS.get(value, value) if name.endswith("class_path") and isinstance(value, str)
            else value for name, value in flat.items()}


def defining_settings(config: dict) -> dict[str, object]:
    return {name: value for name, value in as_first_recorded(flatten(config)).items() if not is_safe_to_change(name)}


def experiment_digest(config: dict) -> str:
    """8 hex digits that differ between experiments (the settings that define one)."""
    settings = {name: value for name, value in defining_settings(config).items()
                if name not in ADDED_SETTINGS or value != ADDED_SETTINGS[name]}
    canonical = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]


def seedless_digest(config: dict) -> str:
    """The digest of the settings that define the experiment but the seed: the runs of one experiment's
    seeds share it (a run's default W&B group, and the experiments `compare --baseline` pairs by seed)."""
    return experiment_digest({name: value for name, value in config.items() if name != "seed"})


def default_out_dir(config: dict, name: str) -> Path:
    return Path("runs") / f"{name}-{experiment_digest(config)}"


def changed_settings(recorded: dict, requested: dict) -> dict[str, tuple[object, object]]:
    """name -> (recorded, requested) for every dotted setting that differs (a retired setting that was
    recorded does not, nor an added setting that was not recorded, at its value then)."""
    new = as_first_recorded(flatten(requested))
    old = {**{name: value for name, value in ADDED_SETTINGS.items() if name in new},
           **as_first_recorded(flatten(recorded))}
    return {name: change for name, change in differences(old, new).items() if name not in RETIRED_SETTINGS}


def differences(old: dict[str, object], new: dict[str, object]) -> dict[str, tuple[object, object]]:
    """name -> (old, new) for every name whose value differs, or that only one of the two has; sorted."""
    missing = object()
    return {name: (old.get(name), new.get(name)) for name in sorted(old.keys() | new.keys())
            if old.get(name, missing) != new.get(name, missing)}


def refused_callback_changes(recorded: list[dict], requested: list[dict]) -> dict[str, tuple[object, object]]:
    """`callbacks.<Class>.<argument>` -> (recorded, requested) for each argument given another value to
    a callback the run had (matched by class, in their order: the second EarlyStopping is
    `callbacks.EarlyStopping#2`), but for those its class declares safe to change
    (`Callback.safe_to_change`). Callbacks added or removed are not compared here: the checkpoint's
    callback states refuse a removed one that kept state."""
    requested_by_class = defaultdict(list)
    for callback in requested:
        requested_by_class[callback["class_path"]].append(callback)
    seen: Counter = Counter()
    refused = {}
    for callback in recorded:
        class_path, occurrence = callback["class_path"], seen[callback["class_path"]]
        seen[class_path] += 1
        if occurrence >= len(requested_by_class[class_path]):
            continue
        safe = resolve_dotted_path(class_path).safe_to_change
        label = class_path.rsplit(".", 1)[-1] + (f"#{occurrence + 1}" if occurrence else "")
        changes = differences(flatten(callback.get("init_args") or {}),
                              flatten(requested_by_class[class_path][occurrence].get("init_args") or {}))
        refused.update({f"callbacks.{label}.{name}": change for name, change in changes.items()
                        if name.split(".")[0] not in safe})
    return refused


class DifferentExperiment(ConfigError):
    """A run folder holds a run made with other settings that define the experiment."""

    def __init__(self, refused: dict[str, tuple[object, object]], source: str, out_dir: Path):
        lines = "\n".join(f"  {name}: {old!r} -> {new!r}" for name, (old, new) in refused.items())
        named_by_them = any(not name.startswith("callbacks.") for name in refused)
        default = "leave out_dir unset for one named after its settings" if named_by_them else \
            "a callback's arguments are not part of the name of the default one"
        super().__init__(
            "out_dir",
            f"a folder of its own for a different experiment: the run in it ({source}) was made with other "
            f"settings, which a resume cannot change:\n{lines}\nKeep those settings to continue that run, or give "
            f"this experiment another out_dir ({default})",
            str(out_dir),
        )
        self.refused = refused
        """name -> (recorded, requested) of each setting that differs."""
        self.source = source

    def fields(self) -> str:
        """`data.alpha 0.5 -> 0.1, seed 0 -> 1`"""
        return ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in self.refused.items())


def check_same_experiment(recorded: dict, requested: dict, source: str, out_dir: Path) -> dict:
    """Refuse a resume whose experiment differs from the recorded one (DifferentExperiment); returns
    the safe changes."""
    changes = changed_settings(recorded, requested)
    refused = {name: change for name, change in changes.items() if not is_safe_to_change(name)}
    refused.update(refused_callback_changes(recorded.get("callbacks") or [], requested.get("callbacks") or []))
    if refused:
        raise DifferentExperiment(refused, source, out_dir)
    return {name: change for name, change in changes.items() if name not in ("resume", "out_dir")}


def recorded_config(out_dir: Path) -> Optional[dict]:
    path = Path(out_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return load_yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError("out_dir", f"a readable {CONFIG_FILE} in the run folder", f"{path} ({err})") from err


def holds_results(out_dir: Path) -> bool:
    return any((Path(out_dir) / name).exists() for name in RUN_FILES)


def remove_results(out_dir: Path) -> None:
    for name in RUN_FILES:
        path = Path(out_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def is_launching_process() -> bool:
    """Whether this process is global rank 0 before Fabric starts (the one that owns out_dir): not
    a rank that Lightning, torchrun or srun started besides it."""
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return os.environ["SLURM_PROCID"] == "0"
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))


class FolderInUse(ConfigError):
    """Another process holds the run folder's lock."""

    def __init__(self, holder: str, out_dir: Path):
        super().__init__("out_dir", f"a folder no other run is using (it is held by {holder})", str(out_dir))
        self.holder = holder


class RunDirLock:
    """An exclusive lock on out_dir for the whole run, so that two runs cannot interleave their
    checkpoints and logs. The kernel drops it when the process dies, so a killed run leaves no
    stale lock behind."""

    def __init__(self, out_dir: Path, name: str = LOCK_FILE):
        self.path = Path(out_dir) / name
        self._lock = FileLock(self.path)

    def acquire(self) -> None:
        try:
            self._lock.acquire()
        except LockHeld as held:
            raise FolderInUse(held.holder, self.path.parent) from held

    def holder(self) -> Optional[str]:
        """Who holds the lock now, or None, asked without taking it (FileLock.holder)."""
        return self._lock.holder()

    def release(self) -> None:
        self._lock.release()


def report_safe_changes(changes: dict) -> None:
    if changes:
        listed = ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in changes.items())
        print(f"resuming with changed settings: {listed}", file=sys.stderr, flush=True)
