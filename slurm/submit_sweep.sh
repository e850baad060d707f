#!/bin/bash
# Submit a sweep plan as one SLURM array job (one task per grid point of slurm/sweep.sbatch); the
# same as `fl-lightning sweep --plan PLAN --mode submit [options]`. Run it from the repository root
# with fl-lightning on PATH (activate its environment first):
#
#   bash slurm/submit_sweep.sh PLAN [--jobs N] [--gpus_per_run G] [--threads_per_run T] \
#       [--sbatch_options "[--time=06:00:00, --partition=gpu]"] [--dry_run true]
set -euo pipefail

if (( $# == 0 )) || [[ $1 == -* ]]; then
    echo "usage: bash slurm/submit_sweep.sh PLAN [fl-lightning sweep options]" >&2
    exit 2
fi
PLAN=$1
shift
exec fl-lightning sweep --plan "$PLAN" --mode submit "$@"
