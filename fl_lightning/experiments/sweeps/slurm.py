"""A sweep as one SLURM array job of slurm/sweep.sbatch, one task per grid point.

Task I asks `fl-lightning sweep --mode fit_config --index I` for the point's settings resolved into one
config file in its run folder, then launches `srun fl-lightning fit --config <that file>` with the
allocation's devices, as slurm/fit.sbatch does (slurm/lib.sh: requeue on SIGUSR1, signal forwarding,
resume). The whole plan is checked before anything is submitted (see sweep.py), so a typo in one
method is an error at submission, not failing array tasks hours later. A plan with a tuning stage
is two array jobs, the second starting after the first (tuning.submit_stages).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from fl_lightning.atomic_files import write_text_atomically
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.resolve import ResolvedPoint, describe_point, fit_settings_text
from fl_lightning.experiments.sweeps.machine import SweepOptions

FIT_CONFIG_FILE = "sweep_fit.yaml"
"""A grid point's resolved `fit` settings, written into its run folder for a SLURM array task."""
SWEEP_SCRIPT = Path("slurm") / "sweep.sbatch"
"""The array job's batch script, relative to the repository root (where jobs are submitted from)."""
JOB_LIBRARY = Path("slurm") / "lib.sh"
"""The functions the batch scripts share; its fl_activate is how a job finds fl-lightning."""


def check_job_finds_fl_lightning() -> None:
    """Refuse to submit array tasks that could not start fl-lightning, each to fail in the queue: a task
    runs slurm/lib.sh's fl_activate (FL_ACTIVATE, then fl-lightning on PATH) in the environment sbatch
    exports to it, this process's, from the folder it is submitted from; so it is run here, the same way."""
    completed = subprocess.run(["bash", "-c", f'set -euo pipefail; source "{JOB_LIBRARY}"; fl_activate'],
                               stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if completed.returncode == 0:
        return
    activate = Path(sys.executable).parent / "activate"
    example = f"FL_ACTIVATE='source {activate}'" if activate.is_file() else "FL_ACTIVATE='source .venv/bin/activate'"
    reason = completed.stderr.strip().splitlines()[-1:] or [f"fl_activate exited {completed.returncode}"]
    raise ConfigError("FL_ACTIVATE", f"a command that puts fl-lightning on PATH in the jobs (e.g. {example} "
                      "fl-lightning sweep ... --mode submit), or fl-lightning on this shell's PATH: the jobs run "
                      "slurm/lib.sh's fl_activate in this environment",
                      f"{os.environ.get('FL_ACTIVATE') or 'unset'}: {reason[0].removeprefix('error: ').split('. ')[0]}")


def write_fit_config(resolved: ResolvedPoint) -> Path:
    """The point's `fit` settings, every config fragment and override resolved, in one file in its run
    folder (out_dir included): what an array task launches, so that the devices of the allocation,
    given after it, override whatever the plan sets."""
    point = resolved.point
    point.out_dir.mkdir(parents=True, exist_ok=True)
    path = point.out_dir / FIT_CONFIG_FILE
    header = (f"# Grid point {point.index} of plan {point.plan_name} ({describe_point(point)}), resolved by\n"
              f"# `fl-lightning sweep --mode fit_config --index {point.index}` for a SLURM array task.\n")
    write_text_atomically(path, header + fit_settings_text(resolved))
    return path


def submit(plan_path: Path, indices: list[int], options: SweepOptions, what: str = "grid points",
           after: Optional[str] = None, tuning_ended: bool = False) -> Optional[str]:
    """sbatch --array=INDICES[%jobs] [--dependency=afterany:AFTER] [resources] slurm/sweep.sbatch PLAN
    --runs_root ROOT [--override=KEY=VALUE ...] [--tuning_ended true]: the array job's id (None in a dry run)."""
    if not SWEEP_SCRIPT.is_file():
        raise ConfigError("slurm", f"{SWEEP_SCRIPT} in the working folder: submit from the repository root",
                          str(Path.cwd()))
    array = array_of(indices) + (f"%{options.jobs}" if options.jobs else "")
    command = ["sbatch", f"--array={array}", *([f"--dependency=afterany:{after}"] if after else [])]
    ranks = max(options.gpus_per_run, 1)
    if options.gpus_per_run:
        command += [f"--ntasks-per-node={ranks}", f"--gpus-per-node={options.gpus_per_run}"]
    if options.threads_per_run:
        command.append(f"--cpus-per-task={max(1, options.threads_per_run // ranks)}")
    command += [*options.sbatch_options, str(SWEEP_SCRIPT), str(plan_path), "--runs_root", str(options.runs_root),
                *[f"--override={override}" for override in options.overrides],
                *(["--tuning_ended", "true"] if tuning_ended else [])]
    after_it = " after it (afterany: each task makes its setting's tuning choice first)" if after else ""
    print(f"{len(indices)} {what} as one array job{after_it}: {shlex.join(command)}", flush=True)
    if options.dry_run:
        return None
    if shutil.which("sbatch") is None:
        raise ConfigError("slurm", "SLURM's sbatch on PATH (run on the cluster's login node)", "no sbatch")
    Path("logs").mkdir(exist_ok=True)  # sbatch does not create the folder of its --output
    completed = subprocess.run(command, capture_output=True, text=True)
    print(completed.stdout, end="", flush=True)  # "Submitted batch job <id>"
    if completed.returncode != 0:
        print(f"error: sbatch exited {completed.returncode}: {completed.stderr.strip()}", file=sys.stderr)
        if options.gpus_per_run and "gres" in completed.stderr.lower():
            print(f"the cluster gives no GPUs where the tasks ask for {options.gpus_per_run} each: choose a partition "
                  'with GPUs (--sbatch_options "[--partition=NAME]"; sinfo -o "%P %G" lists them), or give '
                  "--gpus_per_run 0 to train the runs on the CPU", file=sys.stderr)
        raise SystemExit(1)
    job = re.search(r"(?:Submitted batch job )?(\d+)(;\S*)?\s*$", completed.stdout)
    if job is None:
        raise ConfigError("slurm", "sbatch's line `Submitted batch job <id>` (the id of the job the next depends on)",
                          completed.stdout.strip())
    return job.group(1)


def array_of(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5-5,7-8": sbatch's --array of these tasks."""
    ranges: list[list[int]] = []
    for index in indices:
        if ranges and index == ranges[-1][1] + 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    return ",".join(f"{first}-{last}" for first, last in ranges)
