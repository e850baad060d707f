"""Run logs: metrics.jsonl (always), Weights & Biases (rank 0), and one console line per round.

Every round that ran is in the logs exactly once, whatever stopped the process: each checkpoint
carries the metrics of every round up to it, and a resumed run rewrites metrics.jsonl from them
and replays into W&B the rounds its run lacks. Logging is never allowed to stop training: a W&B
failure is reported once and W&B is left out for the rest of that process. A file of the run that
cannot be written (metrics.jsonl, the W&B folder: a full disk, a read-only folder) is no logging
failure but the run folder's, and ends the run as a checkpoint that cannot be written does
(`fl_lightning.errors.WriteFailed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fl_lightning.atomic_files import failures_reported_as_writes_of, write_text_atomically
from fl_lightning.cluster import slurm_job_id
from fl_lightning.config import LoggerArgs
from fl_lightning.errors import UNWRITABLE_ERRNOS, ConfigError, RunWarning, WriteFailed
from fl_lightning.metric_names import COST_COUNTERS, TEST_ACCURACY, VAL_ACCURACY, best_keys, best_round, final_key
from fl_lightning.run_dir import seedless_digest
from fl_lightning.wandb_file import history_steps, is_finished, read_records

METRICS_FILE = "metrics.jsonl"
# How long an online run may take to reach the server before the run logs offline instead.
DEFAULT_INIT_TIMEOUT_S = 30.0
# How long a finished W&B run waits for W&B's service to write the run's file, and how often it looks.
RUN_FILE_WAIT_S = 30.0
RUN_FILE_POLL_S = 0.02
ENVIRONMENT_MODES = {"online": "online", "offline": "offline", "disabled": "disabled", "dryrun": "offline",
                     "shared": "online", "run": "online"}
"""The values W&B takes for WANDB_MODE -> the logger.wandb_mode each stands for (W&B's `dryrun` is its
old name of offline, `run` of online; `shared`, several writers of one run, logs online)."""


def _json_row(metrics: dict) -> str:
    return json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()})


class MetricsLog:
    """One JSON object per round in out_dir/metrics.jsonl, starting as the rows `history` holds (the
    rounds of the checkpoint the run resumes from), so the file reads as one uninterrupted run."""

    def __init__(self, out_dir: Path, history: list[dict]):
        self.path = Path(out_dir) / METRICS_FILE
        write_text_atomically(self.path, "".join(_json_row(row) + "\n" for row in history))

    def append(self, metrics: dict) -> None:
        # A row cut short by a full disk is the torn last line a resume rewrites from the checkpoint.
        with failures_reported_as_writes_of(self.path), open(self.path, "a") as f:
            f.write(_json_row(metrics) + "\n")


def read_metrics(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


DASHBOARD_KEYS = ("method", "plan", "setting")
"""Tags whose values are also flat keys of the W&B run config, for a dashboard to group and filter by."""


@dataclass
class WandbIdentity:
    """How the run appears on the W&B dashboard."""

    run_id: str
    name: str
    group: str
    tags: list[str]

    def dashboard_config(self) -> dict[str, Optional[str]]:
        """method, plan and setting from the run's `key=value` tags (null where there is no such tag:
        a plain `fit` has no plan and no setting)."""
        keyed = dict(tag.split("=", 1) for tag in self.tags if "=" in tag)
        return {key: keyed.get(key) for key in DASHBOARD_KEYS}


def wandb_identity(config: dict, method: str, run_id: str) -> WandbIdentity:
    """How the run of `config` (the settings `fit` records in config.yaml) appears on W&B: logger.name,
    logger.group and logger.tags where set, else names from its method and settings. W&B averages the
    runs of a group, so a default group holds exactly the runs that differ only by seed: it is named by
    the digest that names the default run folder, taken without the seed. `fit` names its run so, and
    `fl-lightning publish` the run it replays from the run's folder."""
    data, model, logger = config["data"], config["model"], config["logger"]
    experiment = seedless_digest(config)
    constraint = "none" if config["constraint"] is None else config["constraint"]["class_path"].rsplit(".", 1)[-1]
    return WandbIdentity(
        run_id=run_id,
        name=logger["name"] or f"{method}-seed{config['seed']}-{experiment}",
        group=logger["group"] or f"{data['name']}-alpha{data['alpha']}-{model['name']}-{method}-{experiment}",
        tags=run_tags({"method": method, "constraint": constraint, "dataset": data["name"], "alpha": str(data["alpha"]),
                       "model": model["name"]}, logger["tags"]),
    )


def run_tags(own: dict[str, str], extra: list[str]) -> list[str]:
    """The run's `key=value` tags from `own`, but where `extra` (logger.tags) has a tag of the same key,
    which takes its place (a sweep's `method=` is its plan's name for the method, so a run has one
    `method=` tag), plus the other tags of `extra`; sorted."""
    replaced = {tag.split("=", 1)[0] for tag in extra if "=" in tag}
    return sorted({*(f"{key}={value}" for key, value in own.items() if key not in replaced), *extra})


def check_wandb_environment() -> None:
    """Make the WANDB_* variables fit for W&B before it starts. W&B reads its settings from them and
    dies with a pydantic ValidationError on one that is set but empty (`WANDB_MODE= fl-lightning
    ...`) or on a mode it does not know: an empty one is taken as unset, as the batch scripts'
    `${WANDB_MODE:-online}` reads it, and an unknown mode is refused (ConfigError)."""
    for name in [name for name, value in os.environ.items() if name.startswith("WANDB_") and not value]:
        del os.environ[name]
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and mode not in ENVIRONMENT_MODES:
        raise ConfigError("WANDB_MODE", f"one of {', '.join(ENVIRONMENT_MODES)}, or unset", mode)


def with_environment_mode(args: LoggerArgs) -> LoggerArgs:
    """`args` with WANDB_MODE, where it is set, in the place of logger.wandb_mode: the environment is
    the machine's say (a machine without network sets WANDB_MODE=offline for every run it trains),
    a config travels between machines. The run records the mode it logs with (config.yaml)."""
    check_wandb_environment()
    mode = os.environ.get("WANDB_MODE")
    return args if mode is None else dataclasses.replace(args, wandb_mode=ENVIRONMENT_MODES[mode])


def _init_timeout_s() -> float:
    """A short init timeout lets the online -> offline fallback happen quickly; W&B's own
    WANDB_INIT_TIMEOUT, when set, says how long this machine's network deserves."""
    text = os.environ.get("WANDB_INIT_TIMEOUT")
    if text is None:
        return DEFAULT_INIT_TIMEOUT_S
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"WANDB_INIT_TIMEOUT: expected a number of seconds, got {text!r}") from None


class WandbRun:
    """The rank-0 W&B run. Rows are logged with `step=round`, so a round logged twice (a replay
    after a resume) lands on the same step instead of adding a duplicate.

    It calls `wandb.init` itself rather than through Lightning's WandbLogger: the run needs
    explicit steps and an offline fallback, and the logger's fixed arguments make W&B warn about
    a setting that does not apply."""

    def __init__(self, args: LoggerArgs, out_dir: Path, identity: WandbIdentity):
        self.args, self.out_dir, self.identity = args, Path(out_dir), identity
        self._run = None
        self._logged_rounds: list[int] = []

    @property
    def mode(self) -> Optional[str]:
        """online or offline (after an online start that fell back), as the run logs; None while no run
        is open (before `start`, after a failure or `finish`)."""
        if self._run is None:
            return None
        return "offline" if self._run.offline else "online"

    @property
    def run_file(self) -> Optional[Path]:
        """The run's W&B file (what `wandb sync` uploads); None while no run is open."""
        return None if self._run is None else Path(self._run.settings.sync_file)

    def start(self, hyperparameters: dict) -> None:
        """Create (or resume) the run; an unreachable server in online mode falls back to offline."""
        try:
            self._run = self._init(self.args.wandb_mode, hyperparameters)
        except Exception as err:  # wandb raises several error types when the server is unreachable
            self._refuse_unwritable_folder(err)
            if self.args.wandb_mode != "online":
                return self._disable("start", err)
            warnings.warn(f"W&B online init failed ({err}); logging offline instead", RunWarning, stacklevel=2)
            import wandb

            wandb.teardown()  # the failed run still holds its id in the W&B service
            try:
                self._run = self._init("offline", hyperparameters)
            except Exception as offline_err:
                self._disable("start", offline_err)

    def _refuse_unwritable_folder(self, err: Exception) -> None:
        """A W&B folder that cannot be written is a run folder that cannot be written (WriteFailed),
        not a W&B failure to log past: offline or online, W&B keeps its files there."""
        if isinstance(err, OSError) and err.errno in UNWRITABLE_ERRNOS:
            raise WriteFailed(err.filename or self.out_dir / "wandb", err) from err

    def _init(self, mode: str, hyperparameters: dict):
        import wandb

        settings = wandb.Settings(silent=True, **({"init_timeout": _init_timeout_s()} if mode == "online" else {}))
        run = wandb.init(
            project=self.args.project, name=self.identity.name, group=self.identity.group, tags=self.identity.tags,
            dir=str(self.out_dir), id=self.identity.run_id, resume="allow", mode=mode, settings=settings,
            config={**hyperparameters, **self.identity.dashboard_config()},
        )
        # The cost counters are x-axes (a dashboard's panels plot the metrics against them): declared to W&B as
        # metrics of their own, as a custom x-axis is, with the summary the plain last value (what the run spent).
        for counter in COST_COUNTERS:
            run.define_metric(counter)
        return run

    def replay(self, history: list[dict]) -> None:
        """Log the rows of `history` this W&B run lacks: all of them in a new offline file, those
        past the server's last step for an online run."""
        if self._run is None:
            return
        first_missing = self._run.step
        for row in history:
            if row["round"] >= first_missing:
                self.log(row)

    def log(self, metrics: dict) -> None:
        if self._run is not None and self._call("log", lambda: self._run.log(metrics, step=metrics["round"])):
            self._logged_rounds.append(metrics["round"])

    def finish(self, history: list[dict], folder_writable: bool = True) -> None:
        """Record the final and best test accuracy in the run's summary (`run_summary`: what a
        dashboard's bars and table compare), then close the run, and wait until W&B's service has
        written every round this process logged into the run's file (`run.finish` returns before it
        has), or warn naming what the file lacks: a requeue or exit right after would otherwise lose
        the last rounds. In a run folder that cannot be written (`folder_writable` false: the run
        ends on it) the run is only closed (`_close_unwritable`).

        Under SLURM, W&B's service is then shut down (`wandb.teardown`), not left to W&B's exit
        hook: Slurm sends SIGTERM to every process of the job step, the service included, on
        scancel, preemption and the run's own requeue, and the hook would print a traceback on
        finding the service gone. Elsewhere the service may be the caller's too (`fit` called from
        Python), so it is left running."""
        if not folder_writable:
            self._close_unwritable()
        summary = run_summary(history)
        if self._run is not None and summary:
            self._call("write the summary", lambda: self._run.summary.update(summary))
        if self._run is not None:
            run_file = self.run_file
            finished = self._call("finish", self._run.finish)
            self._run = None
            if finished:
                self._wait_for_run_file(run_file)
        if slurm_job_id() is not None:
            _shut_down_wandb_service()

    def _close_unwritable(self) -> None:
        """Close the run whose folder cannot be written, saying nothing of what fails: W&B can save
        neither its summary nor its file there, and its own log, in that folder too, would print a
        `--- Logging error ---` traceback for each line. The same command, once the folder can be
        written, replays the rounds the W&B run lacks."""
        if self._run is None:
            return
        raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
        try:
            with contextlib.suppress(Exception):
                self._run.finish()
        finally:
            logging.raiseExceptions = raise_exceptions
            self._run = None

    def _wait_for_run_file(self, run_file: Path) -> None:
        # W&B has no call that waits for its service to write a finished run short of shutting the
        # service down, which would also end the runs of a Python caller: the file is read instead.
        deadline = time.monotonic() + RUN_FILE_WAIT_S
        records = read_records(run_file) if run_file.exists() else []
        while not is_finished(records) and time.monotonic() < deadline:
            time.sleep(RUN_FILE_POLL_S)
            records = read_records(run_file) if run_file.exists() else []
        missing_rounds = sorted(set(self._logged_rounds) - set(history_steps(records)))
        lacking = [f"rounds {missing_rounds}"] if missing_rounds else []
        if not is_finished(records):
            lacking.append("the record of the run's end")
        if lacking:
            print(f"warning: {RUN_FILE_WAIT_S:g} s after W&B finished the run, its file {run_file} lacks "
                  f"{' and '.join(lacking)}; metrics.jsonl holds every round", file=sys.stderr, flush=True)

    def _call(self, what: str, action) -> bool:
        """Whether `action` succeeded; a failure turns W&B off for the rest of the process."""
        try:
            action()
            return True
        except Exception as err:  # a dead W&B service raises ConnectionResetError, BrokenPipeError, ...
            self._disable(what, err)
            return False

    def _disable(self, what: str, err: Exception) -> None:
        print(f"warning: W&B {what} failed ({type(err).__name__}: {err}); W&B logging is off for the rest of "
              f"this process; metrics.jsonl is complete, and a resumed run replays the rounds W&B lacks",
              file=sys.stderr, flush=True)
        self._run = None


def _shut_down_wandb_service() -> None:
    """Shut W&B's service process down and wait for it (`wandb.teardown`; nothing if none runs)."""
    import wandb

    try:
        wandb.teardown()
    except (ConnectionError, SystemExit):
        # The service died of the job's SIGTERM already (scancel, preemption; W&B exits with its
        # non-zero status): nothing is left to close, and a call that failed on it has said so.
        pass


def run_summary(history: list[dict]) -> dict:
    """The W&B summary of a run's metrics rows: its final and best test accuracy, the round of the best
    and what selected it (`fl_lightning.metric_names.best_round`: the best val_accuracy with a
    validation split, else the test set), with a split the best val_accuracy, and the rounds done.
    Empty before any evaluation."""
    best = best_round(history, TEST_ACCURACY)
    if best is None:
        return {}
    summary = {final_key(TEST_ACCURACY): _final_value(history, TEST_ACCURACY), **best.summary(),
               "rounds_done": history[-1]["round"]}
    if best.on_validation:
        summary[best_keys(VAL_ACCURACY)[0]] = best_round(history, VAL_ACCURACY).value
    return summary


def _final_value(history: list[dict], metric: str) -> float:
    return [row[metric] for row in history if row.get(metric) is not None][-1]


def round_line(metrics: dict, rounds: int) -> str:
    """The console line of one round (the progress bar's replacement in batch jobs)."""
    parts = [f"round {metrics['round']}/{rounds}", f"train_loss {metrics['train_loss']:.4f}"]
    if TEST_ACCURACY in metrics:
        parts.append(f"{TEST_ACCURACY} {metrics[TEST_ACCURACY]:.4f}")
    parts.append(f"{metrics['round_seconds']:.2f} s")
    return "  ".join(parts)


def summary_line(history: list[dict], rounds: int, out_dir: Path, stop_reasons: set[str],
                 final_stop: Optional[str] = None) -> str:
    """The run's last line; `final_stop` is the reason of a stop for good (an early stop), which the same
    command does not continue, unlike an interruption."""
    final_round = history[-1]["round"] if history else 0
    why = "; ".join(sorted(stop_reasons)) or "requested by another rank"
    if final_round == rounds:
        state = "finished"
    elif final_stop is not None:
        state = f"stopped for good ({final_stop}; the same command trains nothing more)"
    else:
        state = f"stopped ({why}; checkpoint saved)"
    best = best_round(history, TEST_ACCURACY)
    accuracy = "" if best is None else (f"; final {TEST_ACCURACY} {_final_value(history, TEST_ACCURACY):.4f}, "
                                        f"best {best.value:.4f} ({best.describe()})")
    return f"{state} at round {final_round}/{rounds}{accuracy}; outputs in {out_dir}"


def new_wandb_run(args: LoggerArgs, out_dir: Path, identity: WandbIdentity) -> Optional[WandbRun]:
    return None if args.wandb_mode == "disabled" else WandbRun(args, out_dir, identity)


PUBLISHED_FILE = "published.json"
"""In a run's wandb/ folder: what `fl-lightning publish` sent of the run, per mode (online, offline):
its W&B run id, project and last round. The folder goes with the run (`overwrite` removes it)."""


def read_published(out_dir: Path) -> dict[str, dict]:
    """mode -> {"run_id", "project", "round"} of what was published of the run in out_dir ({} if nothing)."""
    path = Path(out_dir) / "wandb" / PUBLISHED_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text())  # written atomically: never torn


def record_published(out_dir: Path, mode: str, run_id: str, project: str, last_round: int) -> None:
    published = {**read_published(out_dir), mode: {"run_id": run_id, "project": project, "round": last_round}}
    (Path(out_dir) / "wandb").mkdir(exist_ok=True)
    write_text_atomically(Path(out_dir) / "wandb" / PUBLISHED_FILE, json.dumps(published, indent=2) + "\n")


def is_published(out_dir: Path, mode: str, run_id: str, project: str, last_round: int) -> bool:
    """Whether W&B run `run_id` of `project` got every round up to `last_round` from a publish online, or
    from one in `mode` (an offline publish is no reason not to publish online)."""
    published = read_published(out_dir)
    return any(entry["run_id"] == run_id and entry["project"] == project and entry["round"] >= last_round
               for entry in (published.get("online"), published.get(mode)) if entry is not None)
