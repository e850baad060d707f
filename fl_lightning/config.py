"""Groups of settings for `fl-lightning fit`.

Each dataclass is one group of the command line (`--federation.rounds 300`); its docstring and
field comments become `--help`. Checks that involve one field live in its type (jsonargparse
rejects a negative `PositiveInt` while parsing); checks across fields, or against the machine or
the data, live in `validate` methods, which `fit` runs before anything is computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from jsonargparse.typing import NonNegativeInt, PositiveInt, restricted_number_type

from fl_lightning.choices import DatasetName, Norm, PartitionScheme, Weighting
from fl_lightning.errors import ConfigError
from fl_lightning.participation import Participation, Stragglers, Uniform

# Rates and coefficients must be finite: jsonargparse's PositiveFloat accepts inf (and an
# overflowing 1e999 parses as inf), which would turn the first step into nan.
FinitePositiveFloat = restricted_number_type(
    "FinitePositiveFloat", float, [(">", 0.0), ("<", math.inf)], docstring="A finite float > 0."
)
FiniteNonNegativeFloat = restricted_number_type(
    "FiniteNonNegativeFloat", float, [(">=", 0.0), ("<", math.inf)], docstring="A finite float >= 0."
)

# How error messages and --help name what each restricted type accepts.
TYPE_DESCRIPTIONS = {
    PositiveInt: "an integer > 0",
    NonNegativeInt: "an integer >= 0",
    FinitePositiveFloat: "a finite number > 0",
    FiniteNonNegativeFloat: "a finite number >= 0",
}


@dataclass
class FabricArgs:
    """Where the clients run: Lightning Fabric's accelerator, ranks and precision."""

    accelerator: Literal["auto", "cpu", "cuda", "gpu", "mps"] = "auto"
    """Hardware for the ranks; `auto` takes a GPU when torch sees one, else the CPU."""
    devices: Union[PositiveInt, Literal["auto"]] = "auto"
    """Ranks per node. `auto`: on the CPU one rank per core this process may use (its CPU affinity),
    each running torch on one thread (for small models faster than one rank on every core, and the
    same model to float rounding); under SLURM the allocation's tasks per node; on GPUs every
    visible GPU; in an interactive session (Jupyter), which Fabric cannot launch ranks from, 1. A
    number: that many ranks, torch's threads left as they are; under SLURM it must equal
    --ntasks-per-node."""
    num_nodes: PositiveInt = 1
    """Nodes; under SLURM this must equal --nodes."""
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true"] = "32-true"
    """Numeric precision of local training (Fabric's autocast); 16-mixed needs a GPU."""
    strategy: Literal["auto", "ddp", "ddp_spawn"] = "auto"
    """`auto` picks DDP when there is more than one rank; `ddp_spawn` starts ranks by spawning."""
    process_group_timeout_s: PositiveInt = 1800
    """How long a collective may wait for the slowest rank before the run fails."""

    def validate(self) -> None:
        """Refuse settings this machine cannot honour, before any data is loaded."""
        import torch

        gpu = self.accelerator in ("cuda", "gpu")
        if gpu and not torch.cuda.is_available():
            raise ConfigError("fabric.accelerator", "cpu or auto on a machine where torch sees no CUDA GPU",
                              self.accelerator)
        if gpu and isinstance(self.devices, int) and self.devices > torch.cuda.device_count():
            raise ConfigError("fabric.devices", f"at most the {torch.cuda.device_count()} CUDA GPU(s) torch sees",
                              self.devices)
        if self.accelerator == "mps" and not torch.backends.mps.is_available():
            raise ConfigError("fabric.accelerator", "cpu or auto on a machine without Apple MPS", self.accelerator)
        if self.runs_on_cpu() and self.precision == "16-mixed":
            # Fabric would silently autocast to bf16 while the run records 16-mixed.
            raise ConfigError("fabric.precision", "32-true or bf16-mixed on the CPU (16-mixed needs a GPU)",
                              self.precision)

    def runs_on_cpu(self) -> bool:
        """Whether the ranks run on the CPU: accelerator `cpu`, or `auto` where torch sees no GPU."""
        import torch

        return self.accelerator == "cpu" or (
            self.accelerator == "auto" and not torch.cuda.is_available() and not torch.backends.mps.is_available()
        )


@dataclass
class ComputeArgs:
    """How a rank computes its clients' updates: the same global model whichever is chosen, up to
    float rounding (`loop` is the reference the others are tested against; a network with dropout
    draws other dropout masks when grouped)."""

    client_path: Literal["auto", "loop", "grouped"] = "auto"
    """`loop`: one client after another. `grouped`: a rank's clients advance in lockstep as one
    vectorised computation (torch.func.vmap over their stacked parameters, optimizer state and
    BatchNorm statistics); CTP-FL's clients share each query point, so theirs is one pass over the
    concatenated batches, with one backward pass of their weighted losses unless its clip_norm is
    set (fused). `auto`: grouped on a GPU; on the CPU, grouped for fused CTP-FL clients and the loop
    otherwise (docs/performance.md has the measurements behind this choice)."""
    group_size: Optional[PositiveInt] = None
    """Most clients computed together in the grouped path; null: all of a rank's clients (on the CPU,
    fused CTP-FL clients of at most 512 samples per pass; docs/performance.md says why). On a GPU
    that runs out of memory, a group is split in halves and computed again."""
    channels_last: bool = False
    """Feed images to the network in channels-last memory layout in the loop path (faster
    convolutions on recent GPUs with bf16)."""
    compile: bool = False
    """`torch.compile` a client step's forward pass and its backward in the loop path (the grouped
    path runs under vmap, where it is not compiled). Compiling takes from seconds to minutes once
    per process; measure before relying on it (docs/performance.md)."""
    cpu_threads: Union[PositiveInt, Literal["auto"]] = "auto"
    """torch's intra-op threads of each rank on the CPU. `auto`: one thread for a model of fewer than a
    million parameters (faster for such models, and unharmed by other work on the machine), else the
    CPUs each rank may use (affinity, cgroup quota, SLURM_CPUS_PER_TASK, shared by the node's ranks);
    OMP_NUM_THREADS in the environment takes precedence over `auto`. A rank on a GPU leaves its host threads
    to OpenMP (OMP_NUM_THREADS) and reads none of this (docs/performance.md, "CPU threads of a rank")."""
    client_state_memory_mib: NonNegativeInt = 4096
    """Host memory (MiB) each rank may hold of its clients' state (SCAFFOLD's, FedDyn's, MOON's). Past
    it, the least recently trained clients' states go to files in out_dir/client_states and are read
    back, read ahead in the background, when the client trains again (0: every state as soon as the next
    client has trained); within it nothing is written but checkpoints. The states read ahead take at
    most a quarter of it more (and at least one state). The same model either way, bit for bit
    (docs/performance.md, "Client state in bounded memory")."""


@dataclass
class FederationArgs:
    """The federation: how many clients, how many take part each round, and their local budget."""

    rounds: PositiveInt = 100
    """Communication rounds to train for (a resumed run continues up to this many)."""
    num_clients: PositiveInt = 100
    """Clients the training set is split over (data.partition decides how)."""
    clients_per_round: PositiveInt = 10
    """Clients sampled each round (uniformly, without replacement) from those online (participation);
    all of them when fewer are online."""
    participation: Optional[Participation] = None
    """Which clients are online in each round: null or uniform (all of them), availability, cyclic or
    trace, chosen like the algorithm (a short name, or class_path and init_args; see
    docs/experiments.md, "Participation")."""
    dropout: FiniteNonNegativeFloat = 0.0
    """Probability in [0, 1) that a drawn client's upload is lost after it trained: the server
    aggregates the clients that reported (their weights renormalised) and a dropped client's state
    stays as it was."""
    stragglers: Optional[Stragglers] = None
    """Unequal local work: each client-round's steps, from a speed class per client, a jitter per
    round and a deadline in steps (init_args speeds, jitter, deadline); null: every client does its
    planned steps. An algorithm's client weights stay as it defines them."""
    local_steps: Optional[PositiveInt] = None
    """Mini-batches per client per round (K). Set exactly one of local_steps and local_epochs."""
    local_epochs: Optional[PositiveInt] = None
    """Passes over each client's data per round: K_i = local_epochs * ceil(n_i / batch_size)."""
    batch_size: PositiveInt = 50
    """Local mini-batch size (B)."""
    eval_every: PositiveInt = 1
    """Evaluate the global model on the test split every this many rounds (and at the end)."""
    eval_batch_size: PositiveInt = 500
    """Batch size when evaluating the global model (memory only; the result does not depend on it)."""
    weighting: Optional[Weighting] = None
    """Aggregation weights p_i; None takes the algorithm's default (its paper's choice)."""

    def __post_init__(self) -> None:
        if isinstance(self.participation, Uniform):
            self.participation = None  # one way to say "every client online": uniform and null are one experiment

    @property
    def online_clients(self) -> Participation:
        """The participation model the rounds draw from (uniform when none is set)."""
        return self.participation or Uniform()

    def validate(self) -> None:
        self.online_clients.check(self.num_clients)
        if self.dropout >= 1:
            raise ConfigError("federation.dropout", "a probability in [0, 1) (1 would lose every upload)", self.dropout)
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

    name: Union[DatasetName, str] = "cifar10"
    """The dataset: cifar10, cifar100, tiny_imagenet, digits (8x8 handwritten digits bundled with
    fl-lightning; no download, root unused), or a loader of your own as module.function, called as
    loader(root=..., download=...) and returning (train, test) ImageDatasets (docs/extending.md)."""
    root: Path = Path("data")
    """Folder holding the dataset in its standard layout (e.g. root/cifar-10-batches-py)."""
    download: bool = False
    """Download the dataset into root when it is missing (needs a network)."""
    partition: PartitionScheme = "dirichlet"
    """How training samples are split over clients: Dirichlet label skew, IID, or label shards."""
    alpha: FinitePositiveFloat = 0.5
    """Dirichlet concentration; smaller is more skewed."""
    min_samples: NonNegativeInt = 10
    """Every client gets at least this many training samples (dirichlet)."""
    shards_per_client: PositiveInt = 2
    """Label shards per client (shards)."""
    augment: bool = True
    """Random crop with padding and horizontal flip, batched on the device."""
    crop_padding: NonNegativeInt = 4
    """Zero padding (pixels per side) before the random crop (augment)."""
    validation: Optional[FiniteNonNegativeFloat] = None
    """Fraction in [0, 1) of each client's training samples held out from its training (a seeded draw
    from the client's own samples, so it carries the client's label skew; at least one sample per
    client). The global model is evaluated on them with the test split (val_accuracy, val_loss), and
    `fl-lightning table --at best` selects each run's round by them. null or 0: none (the data of
    every client is as without this setting)."""
    per_client_eval: bool = False
    """With a validation split: also report the global model's accuracy on each client's held-out
    samples, summarised over clients (client_val_accuracy_mean, _std, _min, _p10). It changes no
    result and costs no extra pass: the validation pass counts per client anyway."""

    def __post_init__(self) -> None:
        # One field, but no type can say "a built-in name or an importable loader": checked here, so
        # that a bad name fails while the settings are read, before any run folder is made.
        from fl_lightning.data.datasets import check_dataset_name

        check_dataset_name(self.name)
        if self.validation is not None and not 0 <= self.validation < 1:
            raise ConfigError("data.validation", "null or a fraction in [0, 1)", self.validation)
        if self.validation == 0:
            self.validation = None  # one way to say "none": 0 and null are the same experiment
        if self.per_client_eval and self.validation is None:
            raise ConfigError("data.per_client_eval", "false unless data.validation holds samples out (> 0)",
                              self.per_client_eval)


@dataclass
class ModelArgs:
    """The network: a registered name (linear, mlp, lenet5, resnet18, vit_tiny), a factory of your own,
    or any timm model."""

    name: str = "resnet18"
    """Model name: linear, mlp, lenet5, resnet18, vit_tiny, any timm model name (random init), or a
    factory of your own as module.function, called as factory(num_classes=..., in_channels=...,
    image_size=..., norm=..., bias=..., **options) (docs/extending.md)."""
    norm: Norm = "bn"
    """Normalisation layers where the model has them (resnet18)."""
    bias: bool = True
    """Biases in conv and linear layers (FedCONST trains without)."""
    options: dict = field(default_factory=dict)
    """Extra keyword arguments for the model constructor (e.g. {patch_size: 4, hidden: 200})."""

    def __post_init__(self) -> None:
        # As for DataArgs.name: an unknown name, an unusable factory or an option the model does not
        # take fails while the settings are read.
        from fl_lightning.models.registry import check_model_settings

        check_model_settings(self.name, self.options)


@dataclass
class ClientOptimizerArgs:
    """The clients' local SGD; its state (momentum) is reset at the start of every round."""

    lr: FinitePositiveFloat = 0.01
    """Local learning rate (eta_l)."""
    momentum: FiniteNonNegativeFloat = 0.0
    """Heavy-ball momentum of the local SGD, in [0, 1)."""
    weight_decay: FiniteNonNegativeFloat = 0.0
    """L2 penalty added to each local gradient (weight_decay * parameters)."""
    nesterov: bool = False
    """Nesterov momentum (needs momentum > 0)."""
    grad_clip_norm: Optional[FinitePositiveFloat] = None
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
    """W&B mode: online, offline (sync later with `wandb sync`) or disabled (no W&B at all; `fl-lightning
    publish PLAN` sends a plan's finished runs later). WANDB_MODE, when set, takes its place."""
    project: str = "fl-lightning"
    """W&B project the run is logged to."""
    group: Optional[str] = None
    """Runs of one experiment share a group (W&B averages a group); None uses
    dataset-alpha<α>-model-method-<digest of the experiment's settings but the seed>, which holds
    exactly the runs that differ only by seed."""
    name: Optional[str] = None
    """Run name; None uses method-seed<seed>-<the group's digest>."""
    tags: list[str] = field(default_factory=list)
    """Extra tags; method=, constraint=, dataset=, alpha= and model= are always added, unless a tag
    given here has that key (key=value), which takes the place of the run's own."""
    progress_bar: bool = True
    """Show a progress bar over rounds (rank 0)."""


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
