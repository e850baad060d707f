"""`fl-lightning dashboard`: a plan's W&B report, comparing its methods setting by setting.

    fl-lightning dashboard configs/plans/smoke.yaml                  # create the report in W&B
    fl-lightning dashboard configs/plans/smoke.yaml --offline        # only write its spec
    fl-lightning dashboard configs/plans/smoke.yaml --entity my-team --band std

A W&B report rather than a workspace: a workspace has one run set for all its sections, so a
section could not hold one setting's runs only; each panel grid of a report has a run set of its
own, filtered and grouped, with its runs table under the panels. The report (built with W&B's
wandb-workspaces library) holds:

- one section per setting of the plan, in the plan's order, headed by its label (`α = 0.1`, as
  `fl-lightning table` labels its columns) and its setting name (`alpha-0.1`). Its runs are those
  tagged `plan=<plan>` (the tag `fl-lightning sweep` gives each run) whose W&B config has
  `setting: <setting name>`, grouped by the config's `method`, so that a W&B group is one method's
  seeds;
- in each section: test accuracy, validation accuracy (`val_accuracy`, logged when
  `data.validation` holds samples out) and training loss against the round (W&B's step), and when
  the plan's runs evaluate each client (`data.per_client_eval`) the mean, 10th percentile and
  minimum of the clients' accuracies (`client_val_accuracy_mean`, `_p10`, `_min`), one line per
  method, the mean over its seeds with a band from their minimum to their maximum (`--band
  minmax`) or mean ± std (`--band std`); bars of the final and best test accuracy (each run's
  summary) per method, the best's title saying how it was selected (at the round of the best
  val_accuracy for runs with a validation split, else on the test set: `fl_lightning.metric_names`);
  the runs table, one row per method with its final and best test accuracy, the best's round and
  what selected it; after the diagnostics' panels (below), test accuracy against each cost counter
  the runs log (cost_samples, cost_grad_evals, ..., `fl_lightning.metric_names.COST_COUNTERS`), the
  counter as the panel's x-axis in place of the step (the runs declare the counters to W&B with
  `define_metric`), so that methods are compared at equal computation, communication and time;
- for each diagnostic that the plan's runs turn on (`callbacks:`; see docs/diagnostics.md), a
  panel per group of the metrics it logs: one for the names under each prefix (`hessian/*`, all
  the metrics whose name starts with `hessian/`) and one for each name without one
  (`drift_diversity`).

Its spec (JSON: title, entity, project and, per section, its filters, grouping, runs table
columns and panels) is written first, to `out`, once the inputs are accepted (a `WANDB_MODE` that
W&B does not know is refused; an empty one is unset); the report is then built from it. Without
W&B (`--offline`, `WANDB_MODE` offline or disabled, or no W&B API key) that is all, and the
command that creates the report later is printed: the same command, where W&B can be reached. A
report that W&B refuses, or cannot be reached for, leaves the spec and that command too, and the
command exits 1. A note counts the plan's runs that W&B lacks, from what each run folder records
(`wandb_standing`), and names `fl-lightning publish` (fl_lightning.experiments.results.publish), which sends
them and builds the report.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from fl_lightning.atomic_files import write_text_atomically
from fl_lightning.configurable import resolve_dotted_path
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import Plan, load_plan
from fl_lightning.experiments.plans.resolve import ResolvedPoint, check_grid
from fl_lightning.experiments.plans.tuning import tuned_grid
from fl_lightning.experiments.results.table_sources import setting_label
from fl_lightning.metric_names import (
    CLIENT_VAL_ACCURACY_MEAN,
    CLIENT_VAL_ACCURACY_MIN,
    CLIENT_VAL_ACCURACY_P10,
    COST_COUNTERS,
    TEST_ACCURACY,
    VAL_ACCURACY,
    best_keys,
    final_key,
    selection,
)
from fl_lightning.run_dir import recorded_config
from fl_lightning.run_logging import check_wandb_environment, read_published

SPEC_FILE = "dashboard.json"
"""The spec's file in runs/<plan>/ unless `out` names another."""
METHOD_KEY = "method"
SETTING_KEY = "setting"
"""Keys of each sweep run's W&B config: its method and its setting name."""
CURVES = (TEST_ACCURACY, VAL_ACCURACY, "train_loss")
"""Metrics drawn against the round in every section."""
PER_CLIENT_CURVES = (CLIENT_VAL_ACCURACY_MEAN, CLIENT_VAL_ACCURACY_P10, CLIENT_VAL_ACCURACY_MIN)
"""Metrics drawn against the round when the plan's runs evaluate each client (data.per_client_eval)."""
FINAL, BEST, BEST_ROUND, BEST_SELECTED_ON = final_key(TEST_ACCURACY), *best_keys(TEST_ACCURACY)
"""Summary values of each run (written when it finishes, `fl_lightning.run_logging.run_summary`):
the bars (final and best) and the runs table's columns (all four)."""
BANDS = {"minmax": "minmax", "std": "stddev"}
"""`band` -> W&B's range function of a group's lines and bars."""
TITLE_LENGTH = 128
"""The longest title W&B takes for a report."""
OFFLINE_MODES = ("offline", "dryrun", "disabled")
"""Values of WANDB_MODE under which nothing is sent to W&B."""

DIAGNOSTIC_METRICS: dict[str, tuple[str, ...]] = {
    "fl_lightning.diagnostics.landscape.Landscape": ("hessian/",),
    "fl_lightning.diagnostics.ctpfl.DisplacementBias": ("ctpfl/",),
    "fl_lightning.diagnostics.local_updates.ClientDrift": ("client_drift/",),
    "fl_lightning.diagnostics.local_updates.DriftDiversity": ("drift_diversity",),
    "fl_lightning.diagnostics.local_updates.ClientConsistency": ("client_consistency",),
    "fl_lightning.diagnostics.local_updates.UpdateCosine": ("update_cosine",),
    "fl_lightning.diagnostics.gsnr.GradientVariance": ("gradient_variance", "gradient_variance/"),
    "fl_lightning.diagnostics.gsnr.GSNR": ("gsnr/", "weight_abs/"),
    "fl_lightning.diagnostics.gsnr.WeightNorms": ("weight_norm/",),
}
"""Each diagnostic (a subclass logs what its class does) -> what it adds to the metrics row: metric
names, and name prefixes ending in `/` that stand for every name under them."""


def dashboard(
    plan: Path,
    entity: Optional[str] = None,
    project: Optional[str] = None,
    title: Optional[str] = None,
    band: Literal["minmax", "std"] = "minmax",
    offline: bool = False,
    out: Optional[Path] = None,
    runs_root: Path = Path("runs"),
    override: Optional[list[str]] = None,
) -> dict:
    """Create the W&B report comparing a plan's methods, a section per setting (or only write its spec).

    Writes the report's spec (JSON) first; without W&B (--offline, WANDB_MODE offline or disabled,
    no API key) only the spec, and prints the command that creates the report later.

    Args:
        plan: the plan file (YAML; docs/experiments.md, "The plan file") whose sweep runs the report shows.
        entity: W&B entity (user or team) of the report and the runs; default the API key's default entity.
        project: W&B project of the runs (and the report); default the plan's runs' logger.project.
        title: the report's title; default "<plan>: methods compared".
        band: the band around each method's mean over seeds: minmax (minimum to maximum) or std
            (mean ± std).
        offline: only write the spec, whether or not W&B can be reached.
        out: the spec's file; default runs/<plan>/dashboard.json.
        runs_root: the folder holding runs/<plan>/ (where the spec goes by default).
        override: KEY=VALUE settings applied last to every grid point, as given to `fl-lightning sweep`
            (repeat --override for several): the report of that variant of the plan (its runs are
            tagged plan=<variant>).
    """
    if not offline:
        check_wandb_environment()
    report = plan_report(Path(plan), project=project, runs_root=Path(runs_root), override=override)
    return create_plan_report(report, ["fl-lightning", "dashboard", str(plan)], entity=entity, title=title,
                              band=band, offline=offline, out=out)


@dataclass
class PlanReport:
    """A plan read for its report: its grid points resolved and accepted, its runs' settings, the project."""

    plan: Plan
    resolved: list[ResolvedPoint]
    runs: _RunsSettings
    project: str
    runs_root: Path
    override: Optional[list[str]]

    def plan_options(self) -> list[str]:
        """The options of a command line that finds the same runs: --runs_root unless the default, --override."""
        root = [] if self.runs_root == Path("runs") else ["--runs_root", str(self.runs_root)]
        return root + [f"--override={setting}" for setting in self.override or []]


def plan_report(plan: Path, project: Optional[str], runs_root: Path, override: Optional[list[str]]) -> PlanReport:
    """The plan's own runs, a tuned method's with its setting's choice (or `waiting` for it), resolved as
    `fit` resolves them (a plan with a point `fit` would refuse, or with overrides that `check_overrides`
    refuses, is refused), and the project its report shows."""
    grid = tuned_grid(load_plan(plan, runs_root=runs_root, overrides=override))
    loaded, resolved = grid.plan, grid.final()
    check_grid(loaded.path, resolved)
    runs = _runs_settings(resolved)
    if project is None:
        if len(runs.projects) > 1:
            raise ConfigError("project", "one W&B project for the report (the plan's runs log to several: "
                              "name the one to show with --project)", sorted(runs.projects))
        project = next(iter(runs.projects))
    return PlanReport(plan=loaded, resolved=resolved, runs=runs, project=project, runs_root=runs_root,
                      override=override)


def create_plan_report(report: PlanReport, command: list[str], entity: Optional[str], title: Optional[str],
                       band: Literal["minmax", "std"], offline: bool, out: Optional[Path]) -> dict:
    """Write the report's spec, then create the report in W&B where it can be reached; else print
    `command` with the options that make the same report: what creates it later."""
    loaded, runs, project = report.plan, report.runs, report.project
    spec = dashboard_spec(loaded, project=project, entity=entity, title=title, band=band,
                          diagnostics=runs.diagnostics, selected_on=runs.selected_on,
                          per_client_eval=runs.per_client_eval)
    path = Path(out) if out is not None else report.runs_root / loaded.name / SPEC_FILE
    _write_spec(spec, path, report)
    later = shlex.join([*command, *_options(entity, project, title, band, runs), *report.plan_options()])
    _create(spec, path, later, offline)
    return spec


def _write_spec(spec: dict, path: Path, report: PlanReport) -> None:
    """The report's spec written, said, and with it which of the plan's runs W&B lacks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(spec, indent=2, ensure_ascii=False) + "\n")
    sections, name = spec["sections"], report.plan.name
    print(f"W&B report of plan {name}: {len(sections)} section(s) ({', '.join(s['name'] for s in sections)}), "
          f"{len(sections[0]['panels'])} panels each; runs tagged plan={name} in W&B project {report.project}, "
          f"grouped by config.{METHOD_KEY}")
    print(f"spec: {path}")
    lacking = Counter(where for where in map(wandb_standing, report.resolved) if where != IN_WANDB)
    if lacking:
        how = ", ".join(f"{count} {where}" for where, count in sorted(lacking.items()))
        print(f"note: W&B lacks {sum(lacking.values())} of the plan's {len(report.resolved)} runs ({how}); "
              f"`{shlex.join(['fl-lightning', 'publish', str(report.plan.path), *report.plan_options()])}` sends "
              "the logs of those that have run and builds this report")


def _create(spec: dict, path: Path, later: str, offline: bool) -> None:
    """The report created in W&B where it can be reached, else the command (`later`) that creates it."""
    reason = why_offline(offline)
    if reason is not None:
        print(f"not created in W&B ({reason}); to create it, where W&B can be reached with an API key "
              f"(`wandb login`):\n  {later}")
        return
    try:
        url = create_report(spec)
    except Exception as err:  # wandb and its HTTP client raise many types when the server is unreachable or refuses
        print(f"error: the W&B report was not created ({type(err).__name__}: {err}); the spec is in {path}; "
              f"to try again:\n  {later}", file=sys.stderr)
        raise SystemExit(1) from err
    print(f"W&B report: {url}")


IN_WANDB = "in W&B"


def wandb_standing(entry: ResolvedPoint) -> str:
    """Where a grid point's run stands with W&B, from what its folder records (config.yaml: the mode
    `fit` logged with; what `fl-lightning publish` sent) or, before it has run, its settings: IN_WANDB
    (logged online, or published online), else why W&B lacks it."""
    folder = entry.point.out_dir
    recorded = recorded_config(folder)
    if recorded is None:
        return f"not run yet, with logger.wandb_mode {entry.config['logger']['wandb_mode']}"
    if recorded["logger"]["wandb_mode"] == "online" or "online" in read_published(folder):
        return IN_WANDB
    if recorded["logger"]["wandb_mode"] == "offline" or "offline" in read_published(folder):
        return "logged offline, not sent"
    return "logged with logger.wandb_mode disabled"


def dashboard_spec(plan: Plan, project: str, entity: Optional[str], title: Optional[str],
                   band: Literal["minmax", "std"], diagnostics: list[str], selected_on: set[str],
                   per_client_eval: bool) -> dict:
    """The report of `plan`'s runs in `project`, as plain data (see the module's docstring);
    `diagnostics` are the class paths of the callbacks its runs turn on, `selected_on` what selects
    the round of their best test accuracy (val_accuracy for runs with a validation split,
    test_accuracy for the others) and `per_client_eval` whether any evaluates each client."""
    if band not in BANDS:
        raise ConfigError("band", f"one of {', '.join(BANDS)}", band)
    title = title or f"{plan.name}: methods compared"
    if len(title) > TITLE_LENGTH:
        raise ConfigError("title", f"at most {TITLE_LENGTH} characters (W&B's limit for a report's title)", title)
    settings: dict[str, dict[str, str]] = {}
    for point in plan.grid():
        settings.setdefault(point.setting_name, point.setting)
    axis_values = {axis: list(choices) for axis, choices in plan.settings.items()}
    grouping = {"groupby": f"config.{METHOD_KEY}", "aggregate": "mean", "band": BANDS[band]}
    curves = CURVES + (PER_CLIENT_CURVES if per_client_eval else ())
    panels = [{"type": "line", "title": metric, "x": "Step", "title_x": "round", "y": [metric], **grouping}
              for metric in curves]
    selections = sorted(selected_on, reverse=True)  # val_accuracy first
    how_best = " or ".join(selection(TEST_ACCURACY, on_validation=metric == VAL_ACCURACY) for metric in selections)
    panels += [{"type": "bar", "title": panel_title, "metrics": [metric], **grouping}
               for metric, panel_title in ((FINAL, FINAL), (BEST, f"{BEST} ({how_best})"))]
    panels += [_diagnostic_panel(metric, grouping) for metric in diagnostic_metrics(diagnostics)]
    panels += [{"type": "line", "title": f"{TEST_ACCURACY} by {counter}", "x": counter, "title_x": counter,
                "y": [TEST_ACCURACY], **grouping} for counter in COST_COUNTERS]
    return {
        "title": title,
        "description": (f"The runs of plan {plan.name} ({plan.path}): {', '.join(plan.methods)} over "
                        f"{len(plan.seeds)} seed(s), one section per setting. Built by `fl-lightning dashboard`."),
        "entity": entity,
        "project": project,
        "plan": plan.name,
        "best": {"summary": BEST, "selected_on": selections},
        "sections": [{
            "name": name,
            "label": setting_label(setting, axis_values),
            "filters": {"tags": [f"plan={plan.name}"], "config": {SETTING_KEY: name}},
            "groupby": [f"config.{METHOD_KEY}"],
            "columns": [f"summary:{metric}" for metric in (FINAL, BEST, BEST_ROUND, BEST_SELECTED_ON)],
            "panels": panels,
        } for name, setting in settings.items()],
    }


def diagnostic_metrics(class_paths: list[str]) -> list[str]:
    """What the diagnostics among `class_paths` log (see DIAGNOSTIC_METRICS), each once, in order;
    other callbacks add nothing."""
    diagnostics = [resolve_dotted_path(path) for path in DIAGNOSTIC_METRICS]
    metrics: list[str] = []
    for path in class_paths:
        cls = resolve_dotted_path(path)
        for diagnostic, logged in zip(diagnostics, DIAGNOSTIC_METRICS.values()):
            if issubclass(cls, diagnostic):
                metrics += [metric for metric in logged if metric not in metrics]
    return metrics


def _diagnostic_panel(metric: str, grouping: dict) -> dict:
    panel = {"type": "line", "x": "Step", "title_x": "round", **grouping}
    if metric.endswith("/"):
        return {**panel, "title": f"{metric}*", "metric_regex": f"^{re.escape(metric)}"}
    return {**panel, "title": metric, "y": [metric]}


@dataclass
class _RunsSettings:
    """What the plan's runs set that the report depends on."""

    projects: set[str]
    """W&B projects they log to."""
    diagnostics: list[str]
    """Class paths of the callbacks they turn on, each once."""
    selected_on: set[str]
    """What selects the round of their best test accuracy: val_accuracy for runs with a validation
    split (data.validation), test_accuracy for runs without one."""
    per_client_eval: bool
    """Whether any of them evaluates each client (data.per_client_eval)."""


def _runs_settings(resolved: list[ResolvedPoint]) -> _RunsSettings:
    """The W&B projects of the plan's runs and the callbacks they turn on, from each point's settings
    resolved as `fit` resolves them (nothing is trained)."""
    callbacks: list[str] = []
    for entry in resolved:
        callbacks += [callback["class_path"] for callback in entry.config["callbacks"]
                      if callback["class_path"] not in callbacks]
    data = [entry.config["data"] for entry in resolved]
    return _RunsSettings(projects={entry.config["logger"]["project"] for entry in resolved},
                         diagnostics=callbacks,
                         selected_on={VAL_ACCURACY if settings["validation"] else TEST_ACCURACY for settings in data},
                         per_client_eval=any(settings["per_client_eval"] for settings in data))


def _options(entity: Optional[str], project: str, title: Optional[str], band: str, runs: _RunsSettings) -> list[str]:
    """The command line options that rebuild the same report."""
    options = ["--entity", entity] if entity is not None else []
    if runs.projects != {project}:
        options += ["--project", project]
    if title is not None:
        options += ["--title", title]
    return options + (["--band", band] if band != "minmax" else [])


def why_offline(offline: bool) -> Optional[str]:
    """Why nothing is sent to W&B, or None when it is to be tried."""
    if offline:
        return "--offline"
    mode = os.environ.get("WANDB_MODE")
    if mode in OFFLINE_MODES:
        return f"WANDB_MODE={mode}"
    import wandb

    # Reads WANDB_API_KEY, W&B's settings files and ~/.netrc; prompts for nothing, sends nothing.
    if not wandb.login(prompt=False, verify=False):
        return "no W&B API key: `wandb login`, or WANDB_API_KEY"
    return None


def create_report(spec: dict) -> str:
    """Save the report of `spec` in W&B; its URL."""
    report = build_report(spec)
    report.save()
    return report.url


def build_report(spec: dict):
    """The wandb-workspaces Report of `spec` (nothing is sent; the entity, if the spec has none, is
    the API key's default)."""
    import wandb_workspaces.reports.v2 as wr

    entity = spec["entity"]
    if entity is None:
        import wandb

        entity = wandb.Api().default_entity
    blocks = [wr.P(text=spec["description"])]
    for section in spec["sections"]:
        heading = section["label"] if section["label"] == section["name"] else f"{section['label']} ({section['name']})"
        runset = wr.Runset(entity=entity, project=spec["project"], name=section["name"],
                           filters=filter_expression(section["filters"]), groupby=section["groupby"],
                           pinned_columns=section["columns"])
        blocks += [wr.H2(text=heading),
                   wr.PanelGrid(runsets=[runset], panels=[_panel(wr, panel) for panel in section["panels"]])]
    return wr.Report(entity=entity, project=spec["project"], title=spec["title"], description=spec["description"],
                     blocks=blocks, width="fluid")


def _panel(wr, panel: dict):
    grouping = {"title": panel["title"], "groupby": wr.Config(panel["groupby"].removeprefix("config.")),
                "groupby_aggfunc": panel["aggregate"],
                "groupby_rangefunc": panel["band"]}
    if panel["type"] == "bar":
        return wr.BarPlot(metrics=panel["metrics"], **grouping)
    return wr.LinePlot(x=panel["x"], title_x=panel["title_x"], y=panel.get("y", []),
                       metric_regex=panel.get("metric_regex"), **grouping)


def filter_expression(filters: dict) -> str:
    """A section's filters as wandb-workspaces' filter expression: every tag and every config value
    required."""
    terms = [f'Metric("Tags") in [{_literal(tag)}]' for tag in filters["tags"]]
    terms += [f'Config("{key}") == {_literal(value)}' for key, value in filters["config"].items()]
    return " and ".join(terms)


def _literal(value: str) -> str:
    """A string literal of the filter expression. wandb-workspaces reads `=`, `<` and `>` as operators
    wherever they appear, also inside a string (`'plan=smoke'` would become the tag `plan==smoke`), so
    they are written as escapes, which its parser (Python's) turns back into the characters."""
    escaped = repr(str(value))
    for character in "=<>":
        escaped = escaped.replace(character, f"\\x{ord(character):02x}")
    return escaped
