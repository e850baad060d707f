"""`fl-lightning fit`: check every setting, build data, model and Fabric, then run the federation.

The signature of `fit` is the config schema (jsonargparse): each dataclass is a group of the
command line, and `algorithm` / `server_optimizer` are classes chosen with `class_path`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Literal, Optional, Union

import torch
import yaml
from jsonargparse.typing import NonNegativeInt

from fl_lightning.algorithms import Algorithm
from fl_lightning.atomic_files import write_atomically, write_text_atomically
from fl_lightning.callbacks import (
    Callback,
    Evaluate,
    LogToWandb,
    SaveCheckpoint,
    ShowProgress,
    StopOnSignal,
    WriteMetrics,
)
from fl_lightning.checkpoint import (
    LAST,
    checkpoint_dir,
    rerun_advice,
    run_is_over,
)
from fl_lightning.cluster import Ranks, check_signal_name, check_slurm_allocation, ranks_of
from fl_lightning.config import (
    CheckpointArgs,
    ClientOptimizerArgs,
    ComputeArgs,
    DataArgs,
    FabricArgs,
    FederationArgs,
    LoggerArgs,
    ModelArgs,
)
from fl_lightning.configurable import Configurable
from fl_lightning.constraints import Constraint
from fl_lightning.cpu import ThreadChoice, cpu_rank, run_threads
from fl_lightning.data import plot_partition
from fl_lightning.data.partition import ClientSamples, describe_split
from fl_lightning.errors import ConfigError, RunInterrupted
from fl_lightning.federation.participation_plot import PARTICIPATION_PLOT, plot_participation
from fl_lightning.federation.setup import RankInputs, RunSettings, rank_inputs
from fl_lightning.flat import FlatLayout
from fl_lightning.lost_ranks import watch_started_ranks
from fl_lightning.run_dir import (
    CONFIG_FILE,
    PARTITION_PLOT,
    VALIDATION_FILE,
    default_out_dir,
    is_launching_process,
)
from fl_lightning.run_folder import check_writable, complete_logs_of_finished_run, resume_state, taken
from fl_lightning.run_logging import (
    WandbIdentity,
    new_run_id,
    new_wandb_run,
    wandb_identity,
    with_environment_mode,
)
from fl_lightning.server_optimizers import ServerOptimizer, ServerSGD


def fit(
    algorithm: Algorithm,
    model: ModelArgs = ModelArgs(),
    data: DataArgs = DataArgs(),
    federation: FederationArgs = FederationArgs(),
    client_optimizer: ClientOptimizerArgs = ClientOptimizerArgs(),
    server_optimizer: ServerOptimizer = ServerSGD(),  # frozen: one instance serves every call
    constraint: Optional[Constraint] = None,
    fabric: FabricArgs = FabricArgs(),
    compute: ComputeArgs = ComputeArgs(),
    logger: LoggerArgs = LoggerArgs(),
    checkpoint: CheckpointArgs = CheckpointArgs(),
    callbacks: Optional[list[Callback]] = None,
    seed: NonNegativeInt = 0,
    out_dir: Optional[Path] = None,
    resume: Optional[Union[Literal["auto"], Path]] = "auto",
    overwrite: bool = False,
) -> torch.Tensor:
    """Train a federation and write its logs and checkpoints to out_dir.

    Args:
        algorithm: the federated algorithm (class_path/init_args, class name, or a short name on the
            command line: fedavg, ctpfl).
        model: the network.
        data: the dataset and its split over clients.
        federation: clients, rounds and local budget.
        client_optimizer: the clients' local SGD (local-update algorithms).
        server_optimizer: the server's step on the aggregated pseudo-gradient (ServerSGD lr is the
            server lr gamma; FedAdam, FedYogi, FedAdagrad).
        constraint: a constraint on local training composable with any local-update algorithm
            (CONST: FedCONST's per-channel linear constraints), or null.
        fabric: accelerator, ranks, nodes and precision.
        compute: how a rank computes its clients (one by one or grouped); not part of the experiment.
        logger: Weights & Biases settings.
        checkpoint: checkpoint schedule.
        callbacks: your own callbacks (class_path/init_args), called after evaluation and before the
            checkpoint and logs of each round; e.g. fl_lightning.callbacks.EarlyStopping or TimeBudget.
        seed: seeds the model init, the partition, client sampling and every client's batches.
        out_dir: folder for config.yaml, metrics.jsonl, partition.json, checkpoints/ and wandb/; null
            uses runs/<algorithm>-<dataset>-<model>-seed<seed>-<digest of the experiment's settings>,
            a folder of its own for every experiment.
        resume: "auto" continues the run in out_dir from its newest good checkpoint (if any); a path
            resumes from that checkpoint; null starts fresh. A resume refuses settings that differ
            from the run's (more rounds, logging, checkpointing and devices may change).
        overwrite: replace the run already in out_dir (its results are removed) and train from round 0,
            with resume left at auto or null; refused with resume naming a checkpoint. Without it, resume
            null over a folder that holds a run is refused.

    Returns the final global parameters as one flat tensor, in the module's parameter order.
    """
    settings = RunSettings(
        algorithm=algorithm, model=model, data=data, federation=federation, client_optimizer=client_optimizer,
        server_optimizer=server_optimizer, constraint=constraint, fabric=fabric, compute=compute, logger=logger,
        checkpoint=checkpoint, callbacks=list(callbacks or []), seed=seed,
    )
    return train_run(fit_config(settings, out_dir=out_dir, resume=resume, overwrite=overwrite))


def train_run(checked: FitConfig) -> torch.Tensor:
    """Check the machine, take the run folder, resume or start, train; the final global parameters."""
    settings, out_dir = checked.settings, checked.out_dir
    settings.fabric.validate()
    check_slurm_allocation(settings.fabric)
    check_writable(out_dir)
    launching = is_launching_process()
    with taken(out_dir, launching):
        try:
            state = resume_state(out_dir, checked.config, settings.federation.rounds, checked.resume,
                                 checked.overwrite, launching)
            return _build_and_train(checked, state, launching)
        except RunInterrupted as err:
            err.advice = rerun_advice(out_dir, err.remedy)
            raise


@dataclasses.dataclass
class FitConfig:
    """What fit's arguments come to before anything is loaded: the run's settings, as config.yaml and
    its checkpoints record them (what a resume compares), its folder, how it resumes, and its method's
    name."""

    settings: RunSettings
    config: dict
    out_dir: Path
    resume: Optional[Union[Literal["auto"], Path]]
    overwrite: bool
    method: str


def fit_config(settings: RunSettings, *, out_dir: Optional[Path], resume: Optional[Union[Literal["auto"], Path]],
               overwrite: bool) -> FitConfig:
    """A run's settings and folder (see `fit`) checked, as far as neither the data nor this machine's
    devices are needed, and turned into the config it records: what `fit` trains, and what a sweep
    checks each grid point against before any run starts."""
    settings = dataclasses.replace(settings, logger=with_environment_mode(settings.logger))  # WANDB_MODE comes first
    settings.algorithm.server_optimizer_for(settings.server_optimizer)  # refuses one the algorithm cannot step with
    _validate_settings(settings, resume, overwrite)
    method = method_name(settings.algorithm.method_name(), constrained=settings.constraint is not None)
    config = _as_config({**{field.name: getattr(settings, field.name) for field in dataclasses.fields(settings)},
                         "out_dir": None, "resume": None if resume is None else str(resume), "overwrite": overwrite})
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(
        config, f"{method}-{settings.data.name}-{settings.model.name}-seed{settings.seed}")
    config["out_dir"] = str(out_dir)
    return FitConfig(settings=settings, config=config, out_dir=out_dir, resume=resume, overwrite=overwrite,
                     method=method)


FOLDER_ARGUMENTS = ("out_dir", "resume", "overwrite")
"""fit's arguments that are its run folder's, not the run's settings."""


def fit_config_of(arguments: dict) -> FitConfig:
    """`fit_config` of fit's keyword arguments as a parsed command line gives them (a grid point's)."""
    settings = RunSettings(**{name: value for name, value in arguments.items() if name not in FOLDER_ARGUMENTS})
    settings.callbacks = list(settings.callbacks or [])
    return fit_config(settings, **{name: arguments[name] for name in FOLDER_ARGUMENTS})


def unused_settings(algorithm: type[Algorithm]) -> dict[str, str]:
    """The groups of settings that a run of `algorithm` records but never reads, each with why: the
    client optimizer of an algorithm whose clients train no local model (Algorithm.trains_locally)."""
    if algorithm.trains_locally:
        return {}
    return {"client_optimizer": f"the clients of {algorithm.__name__} train no local model"}


def method_name(algorithm: str, constrained: bool) -> str:
    """What a run is named, grouped and tagged by (`method=`), and what `compare` calls it: its
    algorithm's name (Algorithm.method_name), with "+const" when FedCONST's constraint is on."""
    return algorithm + ("+const" if constrained else "")


def _validate_settings(settings: RunSettings, resume, overwrite: bool) -> None:
    """Every check of the experiment's settings that needs no data, before anything is loaded or written
    (the devices are checked by `fit`, on the machine that trains)."""
    settings.federation.validate()
    settings.client_optimizer.validate()
    check_signal_name(settings.checkpoint.requeue_signal)
    if overwrite and resume is not None and str(resume) != "auto":
        raise ConfigError("overwrite", "false when resume names a checkpoint (overwrite starts the run in out_dir "
                          "afresh; resuming from a checkpoint continues one)", overwrite)


def _build_and_train(checked: FitConfig, resume_state: Optional[dict], launching: bool) -> torch.Tensor:
    settings, config, out_dir, method = checked.settings, checked.config, checked.out_dir, checked.method
    logger = settings.logger
    identity = wandb_identity(config, method, resume_state["run_id"] if resume_state is not None else new_run_id())
    inputs = rank_inputs(settings, out_dir=out_dir, run_id=identity.run_id, hyperparameters=config,
                         resume_state=resume_state)
    module, rounds = inputs.module, settings.federation.rounds
    if resume_state is not None and run_is_over(resume_state, rounds):
        if launching:
            complete_logs_of_finished_run(logger, out_dir, identity, config, resume_state, rounds)
        module.load_state_dict(resume_state["model"])
        return FlatLayout.of(module.named_parameters()).flatten(dict(module.named_parameters()))

    threads = _cpu_threads(settings, module)
    if launching and threads is not None:
        print(threads.describe(), flush=True)
    engine = _build_fabric(settings.fabric, _run_callbacks(settings.federation, logger, settings.checkpoint,
                                                           settings.callbacks, out_dir, identity))
    # Ranks return nothing: a spawned rank's return value travels through a pipe that a model
    # would block. The final model is the last checkpoint, always written at the end.
    with _threads_of_started_ranks(threads):
        engine.launch(_train_and_record, inputs, threads)
    final = torch.load(checkpoint_dir(out_dir) / LAST, map_location="cpu", weights_only=False)
    module.load_state_dict(final["model"])
    return FlatLayout.of(module.named_parameters()).flatten(dict(module.named_parameters()))


def _run_callbacks(federation: FederationArgs, logger: LoggerArgs, checkpoint: CheckpointArgs,
                   user_callbacks: list[Callback], out_dir: Path, identity: WandbIdentity) -> list[Callback]:
    """The run's callbacks in the order their hooks are called: what the user's callbacks add to a
    round's metrics is checkpointed and logged; W&B is closed before a requeue."""
    wandb = new_wandb_run(logger, out_dir, identity)
    return [
        Evaluate(federation.eval_every),
        *user_callbacks,
        SaveCheckpoint(checkpoint.every),
        WriteMetrics(),
        *([] if wandb is None else [LogToWandb(wandb)]),
        ShowProgress(logger.progress_bar),
        StopOnSignal(checkpoint.requeue_signal),
    ]


def _train_and_record(engine, inputs: RankInputs, threads: Optional[ThreadChoice]) -> None:
    # The loop imports Lightning, which parsing and refusing a command line need not wait for.
    from fl_lightning.federation.loop import train

    precision = inputs.settings.fabric.precision
    with contextlib.nullcontext() if threads is None else cpu_rank(threads, precision):
        if engine.global_rank == 0:
            _write_run_files(inputs)
        train(engine, inputs)
        # Lightning closes an NCCL process group when the process exits but leaves a gloo one to the
        # interpreter's teardown, where its threads can abort a rank after the run has finished.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _cpu_threads(settings: RunSettings, module: torch.nn.Module) -> Optional[ThreadChoice]:
    """Each CPU rank's threads (fl_lightning.cpu), the same in every rank; None off the CPU."""
    return run_threads(settings.fabric.runs_on_cpu(), settings.compute.cpu_threads,
                       sum(p.numel() for p in module.parameters()), _ranks_per_node(ranks_of(settings.fabric)))


@contextlib.contextmanager
def _threads_of_started_ranks(threads: Optional[ThreadChoice]):
    """The ranks Fabric starts take the choice as OMP_NUM_THREADS (its launcher would otherwise set
    the node's cores over its ranks); this process's environment is left as it was."""
    if threads is None:
        yield
        return
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads.threads)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def _write_run_files(inputs: RankInputs) -> None:
    out, data, data_settings = inputs.out_dir, inputs.data, inputs.settings.data
    write_text_atomically(out / CONFIG_FILE, yaml.safe_dump(inputs.hyperparameters, sort_keys=False))
    _write_samples(out / "partition.json", data.partition)
    if data.validation is not None:
        _write_samples(out / VALIDATION_FILE, data.validation)
    # A resumed run has the partition it started with (fit refuses a changed one), and its plot.
    if inputs.resume_state is None or not (out / PARTITION_PLOT).is_file():
        split = describe_split(data_settings.partition, data_settings.alpha, data_settings.shards_per_client)
        plot_partition(data.train.labels.numpy(), data.partition, data.train.num_classes, out / PARTITION_PLOT, split)
    federation = inputs.settings.federation
    if (federation.participation is not None or federation.dropout) and not (out / PARTICIPATION_PLOT).is_file():
        plot_participation(inputs.settings.seed, federation, out / PARTICIPATION_PLOT)


def _write_samples(path: Path, samples: ClientSamples) -> None:
    """{"<client>": [its indices], ...} as json.dumps writes it, client by client (a million clients'
    lists at once would be a spike of Python objects), whole or not at all."""
    write_atomically(path, lambda file: file.writelines(piece.encode() for piece in samples.json_pieces()))


def _build_fabric(args: FabricArgs, callbacks: list[Callback]):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    ranks = ranks_of(args)
    multi_rank = args.num_nodes > 1 or _ranks_per_node(ranks) != 1 or args.strategy != "auto"
    strategy = "auto"
    if multi_rank:
        # No DDP wrapper is ever set up (clients differ per rank); DDPStrategy only gives the
        # process group, launch and all-reduce.
        strategy = DDPStrategy(
            start_method="spawn" if args.strategy == "ddp_spawn" else "popen",
            timeout=timedelta(seconds=args.process_group_timeout_s),
        )
        watch_started_ranks(args.process_group_timeout_s)
    # Lightning hints at srun whenever an srun binary exists, also on a login node where the run is
    # meant to be local; under SLURM the allocation check has already matched the ranks to srun's.
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
    return Fabric(accelerator=args.accelerator, devices=ranks.per_node, num_nodes=args.num_nodes,
                  precision=args.precision, strategy=strategy, callbacks=callbacks)


def _ranks_per_node(ranks: Ranks) -> int:
    """The number of ranks per node, counting what Fabric's `auto` takes on GPUs: every visible one."""
    if isinstance(ranks.per_node, int):
        return ranks.per_node
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _as_config(value):
    """Plain YAML-able form of a setting, in the layout `--config` reads back."""
    if dataclasses.is_dataclass(value):
        return {f.name: _as_config(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Configurable):
        return {"class_path": value.class_path, "init_args": _as_config(value.init_args)}
    if isinstance(value, Path):
        return str(value)
    for plain in (bool, int, float, str):  # jsonargparse's PositiveInt etc. are subclasses
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, (list, tuple)):
        return [_as_config(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_config(v) for k, v in value.items()}
    return value
