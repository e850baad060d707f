#!/bin/bash
# Submit slurm/sweep.sbatch as an array of exactly one task per point of its grid. Run it from the
# repository root, whose logs/ receives the tasks' logs (it is created again if it was deleted:
# sbatch does not create it, and a task without its log folder fails before it starts).
#
#   bash slurm/submit_sweep.sh [sbatch options] [-- fit arguments]
#
# MAX_PARALLEL=N caps how many tasks run at once (--array=0-M%N). Other sbatch options (e.g.
# --time, --partition, --gpus-per-node) pass through; extra arguments for fit go after `--`:
#   bash slurm/submit_sweep.sh --partition gpu -- --federation.rounds 500
set -euo pipefail

SWEEP_SCRIPT=$(dirname "$0")/sweep.sbatch
GRID_SIZE=$(bash "$SWEEP_SCRIPT" --grid-size)
ARRAY=0-$(( GRID_SIZE - 1 ))${MAX_PARALLEL:+%$MAX_PARALLEL}

SBATCH_OPTIONS=()
while (( $# > 0 )) && [[ "$1" != "--" ]]; do
    SBATCH_OPTIONS+=("$1")
    shift
done
if (( $# > 0 )); then
    shift  # the `--`
fi

mkdir -p logs
# The `+` form expands an empty array without tripping `set -u` in bash before 4.4.
sbatch --array="$ARRAY" ${SBATCH_OPTIONS[@]+"${SBATCH_OPTIONS[@]}"} "$SWEEP_SCRIPT" "$@"
