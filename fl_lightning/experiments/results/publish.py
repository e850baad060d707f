"""`fl-lightning publish`: a plan's runs, trained with or without W&B, sent to W&B, then its dashboard.

    fl-lightning publish configs/plans/smoke.yaml               # every finished run, then the report
    fl-lightning publish configs/plans/smoke.yaml --partial     # also the runs that are under way
    fl-lightning publish configs/plans/smoke.yaml --offline     # W&B's offline files only, to `wandb sync`

Each run's logs are complete without W&B (metrics.jsonl, config.yaml, its checkpoints), so a run
folder is replayed into the W&B run that `fit` would have logged: the same project, group, name,
tags and run id (`fl_lightning.run_logging.wandb_identity`, the run id its checkpoints record), its
config.yaml as the W&B config, every round with `step=round`, and the summary of a finished run.
Then the plan's report is built, as `fl-lightning dashboard` builds it.

Publishing twice sends nothing twice. W&B resumes a run whose id it has (`resume="allow"`), and the
rounds are logged from the step the W&B run has reached (`WandbRun.replay`, as a resumed `fit`
replays them): an online W&B run is never given a round twice. An offline W&B run starts at step 0
and holds every round (the newest offline run of a folder is the one to sync); what each publish
sent is recorded in the run's wandb/published.json, and a run whose rounds were all published (online,
or in the same mode) is skipped.

Online unless `--offline` or WANDB_MODE (offline, dryrun) says otherwise, or no W&B API key is found,
in which case the runs are published offline and the command that syncs them printed; WANDB_MODE
disabled is refused (nothing would be sent or written). Not published: runs not started, runs under
way (unless `--partial`) and those without a checkpoint yet (whose run id a restart would replace),
and the tuning stage's runs, which no dashboard shows.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Literal, Optional

from fl_lightning.checkpoint import load_checkpoint, resume_candidates, run_is_over
from fl_lightning.config import LoggerArgs
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.resolve import ResolvedPoint
from fl_lightning.experiments.results.dashboard import create_plan_report, plan_report, why_offline
from fl_lightning.experiments.runs import RunFolder
from fl_lightning.run_logging import (
    WandbRun,
    check_wandb_environment,
    is_published,
    record_published,
    wandb_identity,
)


def publish(
    plan: Path,
    partial: bool = False,
    offline: bool = False,
    project: Optional[str] = None,
    title: Optional[str] = None,
    band: Literal["minmax", "std"] = "minmax",
    out: Optional[Path] = None,
    runs_root: Path = Path("runs"),
    override: Optional[list[str]] = None,
) -> dict:
    """Send a plan's runs to W&B (each run folder's metrics and config replayed into the W&B run `fit`
    would have logged), then create the plan's W&B report, as `fl-lightning dashboard` does.

    Args:
        plan: the plan file (YAML; docs/experiments.md, "The plan file") whose runs are published.
        partial: also publish the runs that have not finished (those with a checkpoint).
        offline: write W&B's offline files of the runs (sent later with `wandb sync`) and the report's
            spec only.
        project: the W&B project the report shows; default the plan's runs' logger.project (each run
            is published to its own).
        title: the report's title; default "<plan>: methods compared".
        band: the band around each method's mean over seeds: minmax (minimum to maximum) or std (mean ± std).
        out: the report's spec file; default runs/<plan>/dashboard.json.
        runs_root: the folder holding runs/<plan>/.
        override: KEY=VALUE settings applied last to every grid point, as given to `fl-lightning sweep`:
            the runs and report of that variant of the plan.
    """
    check_wandb_environment()
    if os.environ.get("WANDB_MODE") == "disabled":
        raise ConfigError("WANDB_MODE", "online, offline or unset to publish (disabled sends nothing to W&B)",
                          "disabled")
    report = plan_report(Path(plan), project=project, runs_root=Path(runs_root), override=override)
    reason = why_offline(offline)
    mode = "online" if reason is None else "offline"
    print(f"publishing the runs of plan {report.plan.name} to W&B {mode}" + ("" if reason is None else f" ({reason})"))
    points = [entry for entry in report.resolved if not entry.point.waiting]
    outcomes = [publish_run(entry, mode, partial) for entry in points]
    run_files = {outcome[1]: outcome[0] for outcome in outcomes if isinstance(outcome, tuple)}
    why_not = [outcome for outcome in outcomes if isinstance(outcome, str)]
    counts = [f"{why_not.count(why)} {why}" for why in sorted(set(why_not))]
    print(f"published {len(run_files)} of {len(points)} runs" + (f"; not: {', '.join(counts)}" if counts else ""))
    offline_runs = [str(run_file.parent) for run_file, run_mode in run_files.items() if run_mode == "offline"]
    if offline_runs:
        print(f"to send the runs published offline to W&B:\n  wandb sync {shlex.join(offline_runs)}")
    return create_plan_report(report, ["fl-lightning", "publish", str(plan)], entity=None, title=title, band=band,
                              offline=offline, out=out)


def publish_run(entry: ResolvedPoint, mode: Literal["online", "offline"], partial: bool) -> tuple[str, Path] | str:
    """Publish the run of a grid point: the mode it was published in and its W&B run file, or why it is
    not published."""
    folder = RunFolder(entry.point.out_dir)
    if not folder.config:
        return "not started"
    if folder.difference(entry.config) is not None:
        return "holding another experiment's run (fl-lightning sweep names it)"
    state = _newest_checkpoint(folder)
    if state is None:
        return "without a checkpoint yet"
    finished = run_is_over(state, entry.rounds)
    if not (partial or finished):
        return "under way (--partial publishes them)"
    history = [*state["metrics"], *[row for row in folder.history if row["round"] > state["round"]]]
    project = folder.config["logger"]["project"]
    identity = wandb_identity(folder.config, folder.method, state["run_id"])
    if is_published(folder.path, mode, identity.run_id, project, history[-1]["round"]):
        return "published before"
    run = WandbRun(LoggerArgs(wandb_mode=mode, project=project), folder.path, identity)
    run.start(folder.config)
    published_mode, run_file = run.mode, run.run_file
    run.replay(history)
    if run.mode is None:  # W&B failed, and said so
        return "failed in W&B"
    run.finish(history if finished else [])  # the summary's final and best are a finished run's
    record_published(folder.path, published_mode, identity.run_id, project, history[-1]["round"])
    print(f"published {folder.path} (rounds 1-{history[-1]['round']}) as W&B run {identity.name} "
          f"({identity.run_id}, project {project}, {published_mode})")
    return published_mode, run_file


def _newest_checkpoint(folder: RunFolder) -> Optional[dict]:
    """The newest checkpoint of the run that passes its checks (what `fit --resume auto` continues); None
    without one."""
    for path in resume_candidates(folder.path):
        try:
            return load_checkpoint(path)
        except ValueError:
            continue
    return None
