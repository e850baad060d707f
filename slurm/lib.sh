# Shared by slurm/fit.sbatch and slurm/sweep.sbatch, which source it (it is not run on its own):
# the environment hook, the allocation checks and the srun launch that
# forwards signals and makes a requeued attempt continue its run. Its names start with fl_ / FL_.
#
# Environment read here:
#   FL_ACTIVATE  a command run before srun that puts fl-lightning on PATH, e.g.
#                'source .venv/bin/activate' or 'eval "$(conda shell.bash hook)" && conda activate fl'
#   ACCELERATOR  gpu or cpu; default gpu when the job was given GPUs, else cpu
#   WANDB_MODE   online | offline | disabled; default online
#   SLURM_RESTART_COUNT  set by Slurm on a requeued attempt (see fl_launch)

fl_die() {
    echo "error: $*" >&2
    exit 1
}

# Runs FL_ACTIVATE (if set), then makes sure fl-lightning can be started.
fl_activate() {
    if [[ -n ${FL_ACTIVATE:-} ]]; then
        echo "activating the environment: $FL_ACTIVATE"
        local status=0
        # Activation scripts (conda's among them) often read unset variables or return non-zero.
        set +eu
        eval "$FL_ACTIVATE"
        status=$?
        set -eu
        if (( status != 0 )); then
            fl_die "FL_ACTIVATE ($FL_ACTIVATE) failed with exit status $status"
        fi
    fi
    if ! command -v fl-lightning >/dev/null 2>&1; then
        fl_die "fl-lightning is not on PATH in the job. Set FL_ACTIVATE to the command that activates" \
            "its environment, e.g. FL_ACTIVATE='source .venv/bin/activate' sbatch slurm/fit.sbatch" \
            "(conda: FL_ACTIVATE='eval \"\$(conda shell.bash hook)\" && conda activate <env>'); see docs/cluster.md"
    fi
}

# The GPUs per node of the allocation: --gpus-per-node=[type:]N, else the GPUs given to the batch
# step (--gres=gpu:N, --gpus=N), else 0.
fl_gpus_per_node() {
    local gpus=${SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
    gpus=${gpus##*:}
    if [[ ! $gpus =~ ^[0-9]+$ ]]; then
        fl_die "cannot read a GPU count from SLURM_GPUS_PER_NODE=${SLURM_GPUS_PER_NODE:-} SLURM_GPUS_ON_NODE=${SLURM_GPUS_ON_NODE:-}"
    fi
    echo "$gpus"
}

# Sets FL_DEVICES, FL_NODES and FL_ACCELERATOR from the allocation (and ACCELERATOR), and stops
# before srun when they cannot work. Fabric insists that devices and num_nodes equal the
# allocation's, so they are read from it: sbatch command-line overrides then reach fit as well.
fl_read_allocation() {
    FL_NODES=${SLURM_NNODES:-}
    [[ -n $FL_NODES ]] || fl_die "SLURM_NNODES is not set: submit this script with sbatch"
    FL_DEVICES=${SLURM_NTASKS_PER_NODE:-}
    [[ -n $FL_DEVICES ]] || fl_die "SLURM_NTASKS_PER_NODE is not set: submit with --ntasks-per-node (one rank per task)"
    local gpus
    gpus=$(fl_gpus_per_node)
    if [[ -z ${ACCELERATOR:-} ]]; then
        if (( gpus > 0 )); then FL_ACCELERATOR=gpu; else FL_ACCELERATOR=cpu; fi
    else
        FL_ACCELERATOR=$ACCELERATOR
    fi
    case "$FL_ACCELERATOR" in
        cpu)
            ;;
        gpu|cuda)
            if (( gpus == 0 )); then
                fl_die "ACCELERATOR=$FL_ACCELERATOR but the job has no GPUs: submit with --gpus-per-node=N" \
                    "(or --gres=gpu:N) and --ntasks-per-node=N, or use ACCELERATOR=cpu"
            fi
            if (( gpus != FL_DEVICES )); then
                fl_die "--gpus-per-node ($gpus) must equal --ntasks-per-node ($FL_DEVICES): one rank per GPU"
            fi
            ;;
        *)
            fl_die "ACCELERATOR must be gpu or cpu, not '$FL_ACCELERATOR'"
            ;;
    esac
    # srun does not inherit --cpus-per-task from sbatch (Slurm >= 22.05).
    if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
        export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
    fi
}

fl_check_config() {
    [[ -f $1 ]] || fl_die "config file '$1' not found in $PWD: submit from the repository root (or give CONFIG as an absolute path)"
}

fl_forward() {
    local signal=$1
    FL_SIGNALLED=$signal
    if [[ -z ${FL_SRUN_PID:-} ]]; then
        echo "$(date -Is) SIG$signal before srun started: exiting" >&2
        exit $(( 128 + $(kill -l "$signal") ))
    fi
    echo "$(date -Is) batch shell got SIG$signal: forwarding it to srun (pid $FL_SRUN_PID)" >&2
    kill -s "$signal" "$FL_SRUN_PID" 2>/dev/null || true
}

# fl_launch CONFIG [FIT_ARGS...]: `srun fl-lightning fit` with the allocation's ranks, requeue on
# SIGUSR1 and resume, then FIT_ARGS (which override everything before them). SIGUSR1 and SIGTERM
# sent to the batch shell (scancel --batch or --full) are forwarded to srun, which relays them to
# the ranks, and ignored once srun has ended. On a requeued attempt (SLURM_RESTART_COUNT > 0), `--resume auto --overwrite false`
# come after FIT_ARGS: the attempt continues from the run's newest checkpoint, and a start-over
# asked for at submission (--overwrite true) is not repeated over the progress the
# earlier attempts made. Returns srun's exit status.
fl_launch() {
    local config=$1
    shift
    local restart_args=()
    if [[ ${SLURM_RESTART_COUNT:-0} != 0 ]]; then
        restart_args=(--resume auto --overwrite false)
        echo "restart $SLURM_RESTART_COUNT: continuing the run in its folder (--resume auto --overwrite false)"
    fi
    FL_SRUN_PID=
    trap 'fl_forward USR1' USR1
    trap 'fl_forward TERM' TERM
    # In the background: a shell runs a trap only after the foreground command ends, but `wait`
    # returns as soon as a trapped signal arrives.
    srun --kill-on-bad-exit=1 fl-lightning fit --config "$config" \
        --fabric.accelerator "$FL_ACCELERATOR" --fabric.devices "$FL_DEVICES" --fabric.num_nodes "$FL_NODES" \
        --checkpoint.requeue_signal SIGUSR1 --resume auto \
        --logger.wandb_mode "${WANDB_MODE:-online}" --logger.progress_bar false \
        "$@" ${restart_args[@]+"${restart_args[@]}"} &
    FL_SRUN_PID=$!
    local status
    while :; do
        FL_SIGNALLED=
        if wait "$FL_SRUN_PID"; then status=0; else status=$?; fi
        # Returned because srun ended, not because a signal interrupted the wait.
        [[ -n $FL_SIGNALLED ]] || break
        if ! kill -0 "$FL_SRUN_PID" 2>/dev/null; then
            # srun ended as the signal came: collect its status (127: the wait above already had).
            local again
            if wait "$FL_SRUN_PID" 2>/dev/null; then again=0; else again=$?; fi
            (( again == 127 )) || status=$again
            break
        fi
    done
    # srun has ended: a stop signal now has nothing to stop, and must not end the job with 138 or 143.
    trap '' USR1 TERM
    FL_SRUN_PID=
    echo "$(date -Is) srun exited with status $status"
    return "$status"
}

# Prints the line that starts every attempt's log.
fl_announce() {
    echo "$(date -Is) job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}): $FL_NODES node(s) x $FL_DEVICES rank(s)" \
        "on $FL_ACCELERATOR, $*"
}
