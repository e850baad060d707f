"""Groups of settings for `fl-lightning fit`.

Each dataclass is one group of the command line (`--federation.rounds 300`); its docstring and
field comments become `--help`. Checks that involve one field live in its type (jsonargparse
rejects a negative `PositiveInt` while parsing); checks across fields or against the data live in
`validate` methods, which `fit` runs before anything is computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from jsonargparse.typing import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt


class ConfigError(ValueError):
    """A setting that cannot work; the message names the field and what was expected."""

    def __init__(self, field_name: str, expected: str, got: object):
        super().__init__(f"{field_name}: expected {expected}, got {got!r}")
        self.field_name = field_name


@dataclass
class FabricArgs:
    """Where the clients run: Lightning Fabric's accelerator, ranks and precision."""

    accelerator: Literal["auto", "cpu", "cuda", "gpu", "mps"] = "auto"
    devices: Union[PositiveInt, Literal["auto"]] = 1
    """Ranks per node; under SLURM this must equal --ntasks-per-node."""
    num_nodes: PositiveInt = 1
    """Nodes; under SLURM this must equal --nodes."""
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true"] = "32-true"
    strategy: Literal["auto", "ddp", "ddp_spawn"] = "auto"
    """`auto` picks DDP when there is more than one rank; `ddp_spawn` starts ranks by spawning."""
    process_group_timeout_s: PositiveInt = 1800
    """How long a collective may wait for the slowest rank before the run fails."""


@dataclass
class FederationArgs:
    """The federation: how many clients, how many take part each round, and their local budget."""

    rounds: PositiveInt = 100
    num_clients: PositiveInt = 100
    clients_per_round: PositiveInt = 10
    """Clients sampled each round (uniformly, without replacement)."""
    local_steps: Optional[PositiveInt] = None
    """Mini-batches per client per round (K). Set exactly one of local_steps and local_epochs."""
    local_epochs: Optional[PositiveInt] = None
    """Passes over each client's data per round: K_i = local_epochs * ceil(n_i / batch_size)."""
    batch_size: PositiveInt = 50
    eval_every: PositiveInt = 1
    """Evaluate the global model on the test split every this many rounds (and at the end)."""
    eval_batch_size: PositiveInt = 500
    weighting: Optional[Literal["num_samples", "uniform"]] = None
    """Aggregation weights p_i; None takes the algorithm's default (its paper's choice)."""

    def validate(self) -> None:
        if self.clients_per_round > self.num_clients:
            raise ConfigError(
                "federation.clients_per_round",
                f"an integer from 1 to federation.num_clients ({self.num_clients})",
                self.clients_per_round,
            )
        if (self.local_steps is None) == (self.local_epochs is None):
            raise ConfigError(
                "federation.local_steps / federation.local_epochs",
                "exactly one of the two set (the other null)",
                {"local_steps": self.local_steps, "local_epochs": self.local_epochs},
            )


@dataclass
class DataArgs:
    """The dataset, where it lies on disk, how it is split over clients and augmented."""

    name: Literal["cifar10", "cifar100", "tiny_imagenet", "digits"] = "cifar10"
    root: Path = Path("data")
    """Folder holding the dataset in its standard layout (e.g. root/cifar-10-batches-py)."""
    download: bool = False
    """Download the dataset into root when it is missing (needs a network)."""
    partition: Literal["dirichlet", "iid", "shards"] = "dirichlet"
    alpha: PositiveFloat = 0.5
    """Dirichlet concentration; smaller is more skewed."""
    min_samples: NonNegativeInt = 10
    """Every client gets at least this many training samples (dirichlet)."""
    shards_per_client: PositiveInt = 2
    """Label shards per client (shards)."""
    augment: bool = True
    """Random crop with padding and horizontal flip, batched on the device."""
    crop_padding: NonNegativeInt = 4


@dataclass
class ModelArgs:
    """The network: a registered name (linear, mlp, lenet5, resnet18, vit_tiny) or any timm model."""

    name: str = "resnet18"
    norm: Literal["bn", "gn", "none"] = "bn"
    """Normalisation layers where the model has them (resnet18)."""
    bias: bool = True
    """Biases in conv and linear layers (FedCONST trains without)."""
    options: dict = field(default_factory=dict)
    """Extra keyword arguments for the model constructor (e.g. {patch_size: 4, hidden: 200})."""


@dataclass
class ClientOptimizerArgs:
    """The clients' local SGD; its state (momentum) is reset at the start of every round."""

    lr: PositiveFloat = 0.01
    momentum: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = 0.0
    nesterov: bool = False
    grad_clip_norm: Optional[PositiveFloat] = None
    """Clip each local gradient to this global L2 norm."""

    def validate(self) -> None:
        if self.momentum >= 1:
            raise ConfigError("client_optimizer.momentum", "a value in [0, 1)", self.momentum)
        if self.nesterov and self.momentum == 0:
            raise ConfigError("client_optimizer.momentum", "> 0 when nesterov is true", self.momentum)


@dataclass
class LoggerArgs:
    """Weights & Biases logging (rank 0), beside the local metrics.jsonl that is always written."""

    wandb_mode: Literal["online", "offline", "disabled"] = "disabled"
    project: str = "fl-lightning"
    group: Optional[str] = None
    """Runs of one experiment share a group; None uses dataset-alpha-model."""
    name: Optional[str] = None
    """Run name; None uses algorithm-seed."""
    tags: list[str] = field(default_factory=list)
    """Extra tags; the algorithm, dataset, alpha and model are always added."""
    progress_bar: bool = True


@dataclass
class CheckpointArgs:
    """Checkpoints in out_dir/checkpoints: written atomically, the newest kept."""

    every: PositiveInt = 10
    """Save every this many rounds (and always after the last round)."""
    keep: PositiveInt = 2
    """How many numbered checkpoints to keep besides last.ckpt."""
    requeue_signal: Optional[str] = "SIGUSR1"
    """Signal (besides SIGTERM) that asks the run to checkpoint at the next round boundary, then
    requeue itself under SLURM (sbatch --signal) and exit 0."""
