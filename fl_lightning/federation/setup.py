"""A run's settings (`RunSettings`, the one value `fit` builds and hands down whole) and what a rank
is given to run the federation (`RankInputs`): the settings beside what their assembly made, the
clients' data (loaded and split as `fit` does, or given), the initial model (created from the seed,
then prepared by the algorithm and the constraint) and the server optimizer the algorithm steps with
(`Algorithm.server_optimizer_for`). `fit`, the benchmarks and the tests assemble every rank's inputs
through `rank_inputs`, so that what they train is the algorithm they name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch
from torch import nn

from fl_lightning.algorithms import Algorithm
from fl_lightning.callbacks import Callback
from fl_lightning.checkpoint import EARLIER_PARTITION, EARLIER_VALIDATION, PARTITION_DIGEST, VALIDATION_DIGEST
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
from fl_lightning.constraints import Constraint
from fl_lightning.data import ClientSamples, ImageDataset, hold_out_validation, load_dataset, partition_indices
from fl_lightning.errors import ConfigError
from fl_lightning.models import create_model
from fl_lightning.server_optimizers import ServerOptimizer, ServerSGD

if TYPE_CHECKING:
    from fl_lightning.module import ClassificationModule


@dataclass
class RunSettings:
    """A run's groups of settings, as `fit.fit` takes them (see there), less its run folder's."""

    algorithm: Algorithm
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    federation: FederationArgs = field(default_factory=FederationArgs)
    client_optimizer: ClientOptimizerArgs = field(default_factory=ClientOptimizerArgs)
    server_optimizer: ServerOptimizer = field(default_factory=ServerSGD)
    """The configured server optimizer; the run steps with `algorithm.server_optimizer_for` of it."""
    constraint: Optional[Constraint] = None
    fabric: FabricArgs = field(default_factory=FabricArgs)
    compute: ComputeArgs = field(default_factory=ComputeArgs)
    logger: LoggerArgs = field(default_factory=LoggerArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    callbacks: list[Callback] = field(default_factory=list)
    seed: int = 0


@dataclass
class RunData:
    """The datasets and each client's training-set indices (and held-out validation indices, or None);
    indices given as a list of arrays (the benchmarks', the tests') are held as ClientSamples."""

    train: ImageDataset
    test: ImageDataset
    partition: ClientSamples
    validation: Optional[ClientSamples] = None

    def __post_init__(self):
        self.partition = ClientSamples.of(self.partition)
        self.validation = None if self.validation is None else ClientSamples.of(self.validation)


@dataclass
class RankInputs:
    """Everything a rank needs to run the federation (picklable, for spawned ranks)."""

    settings: RunSettings
    server_optimizer: ServerOptimizer
    """The server optimizer the algorithm steps with (`Algorithm.server_optimizer_for` of the configured one)."""
    module: ClassificationModule
    data: RunData
    out_dir: Path
    run_id: str
    hyperparameters: dict
    """The run's settings as config.yaml and the checkpoints record them."""
    resume_state: Optional[dict] = None


def rank_inputs(settings: RunSettings, *, out_dir: Path, run_id: str, hyperparameters: dict,
                resume_state: Optional[dict] = None, data: Optional[RunData] = None,
                network: Optional[nn.Module] = None,
                module_type: Optional[Callable[[nn.Module, int], ClassificationModule]] = None) -> RankInputs:
    """What a rank of a run of these settings is given. `data` replaces the dataset that settings.data
    names and its split (the caller's data is not checked against the federation); `network` replaces
    the model that settings.model names, already initialised by the caller, and is prepared all the
    same; `module_type` (network, num_classes) -> module replaces ClassificationModule (a module whose
    training_step computes another loss)."""
    # It imports Lightning, which parsing and refusing a command line need not wait for.
    from fl_lightning.module import ClassificationModule

    algorithm, constraint = settings.algorithm, settings.constraint
    data = data if data is not None else load_run_data(settings, resume_state, out_dir)
    if network is None:
        network = initial_network(settings.model, data.train, settings.seed)
    network = algorithm.prepare_model(network)
    if constraint is not None:
        if not algorithm.trains_locally:
            raise ConfigError("constraint", f"null for {type(algorithm).__name__}, which trains no local model",
                              type(constraint).__name__)
        constraint.prepare_model(network)
    module = (module_type or ClassificationModule)(network, data.train.num_classes)
    return RankInputs(settings=settings, server_optimizer=algorithm.server_optimizer_for(settings.server_optimizer),
                      module=module, data=data, out_dir=out_dir, run_id=run_id, hyperparameters=hyperparameters,
                      resume_state=resume_state)


def initial_network(model: ModelArgs, train: ImageDataset, seed: int) -> nn.Module:
    """The network settings.model names, initialised from the seed: the same on every rank."""
    torch.manual_seed(seed)
    return create_model(model.name, num_classes=train.num_classes, in_channels=train.images.shape[1],
                        image_size=train.images.shape[-1], norm=model.norm, bias=model.bias, **model.options)


def load_run_data(settings: RunSettings, resume_state: Optional[dict], out_dir: Path) -> RunData:
    """The dataset, the clients' training samples and their held-out validation samples (None without
    data.validation), checked against the federation and the checkpoint."""
    data, federation, seed = settings.data, settings.federation, settings.seed
    train_set, test_set = load_dataset(data.name, data.root, data.download)
    partition, validation = split_over_clients(train_set.labels.numpy(), data, federation.num_clients, seed)
    settings.algorithm.check_federation(federation, partition.sizes)
    largest_client = int(partition.sizes.max())
    # Under local_epochs a batch larger than a client is its whole data (full-batch steps); under
    # local_steps every batch of every client would repeat samples.
    if federation.local_steps is not None and federation.batch_size > largest_client:
        raise ConfigError("federation.batch_size", f"at most the largest client's number of samples ({largest_client}) "
                          "with local_steps", federation.batch_size)
    if resume_state is not None and partition.digest() != saved_digest(resume_state, PARTITION_DIGEST,
                                                                       EARLIER_PARTITION):
        raise ConfigError("resume", "a checkpoint made with the same data, partition and seed", str(out_dir))
    if resume_state is not None and (None if validation is None else validation.digest()) != saved_digest(
            resume_state, VALIDATION_DIGEST, EARLIER_VALIDATION):
        raise ConfigError("resume", "a checkpoint made with the same validation samples (data, partition, seed and "
                          "data.validation)", str(out_dir))
    return RunData(train_set, test_set, partition, validation)


def saved_digest(state: dict, digest_key: str, earlier_key: str) -> Optional[str]:
    """The digest (`ClientSamples.digest`) of the clients' samples a checkpoint was made with, as it holds
    it under `digest_key` or, in a checkpoint of an earlier version, of the lists it holds under
    `earlier_key`; None where it holds neither (a run without a validation split)."""
    if digest_key in state:
        return state[digest_key]
    lists = state.get(earlier_key)
    return None if lists is None else ClientSamples.of(lists).digest()


def split_over_clients(labels: np.ndarray, data: DataArgs, num_clients: int, seed: int
                       ) -> tuple[ClientSamples, Optional[ClientSamples]]:
    """Each client's training-set indices and, with data.validation, its held-out ones (else None)."""
    partition = partition_indices(labels, num_clients, data.partition, alpha=data.alpha, min_samples=data.min_samples,
                                  shards_per_client=data.shards_per_client, seed=seed)
    if data.validation is None:
        return ClientSamples.of(partition), None
    training, validation = hold_out_validation(partition, data.validation, seed)
    return ClientSamples.of(training), ClientSamples.of(validation)
