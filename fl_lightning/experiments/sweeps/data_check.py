"""`fl-lightning data`: fetch and check the datasets that runs will read, without training.

    fl-lightning data configs/plans/smoke.yaml                           # every dataset of a plan
    fl-lightning data configs/plans/smoke.yaml --override data.download=true --override data.root=/scratch/data
    fl-lightning data --config configs/settings/cifar10_lenet5_ctpfl.yaml --data.download true   # a fit line's

A plan's datasets are those of its grid points (each resolved as `fit` resolves it); a fit command
line's (its config files, then its options: any `fit` line, less the algorithm, which the data does
not need) is the one its run would read. Each distinct dataset (data.name in data.root) is prepared
as a run's start prepares it: downloaded when it is absent and data.download is true (under the lock
of fl_lightning.data.download, which the runs take too, so that this command and any runs started
meanwhile share one download), decoded into its cache (Tiny-ImageNet), and read, both splits. One
line per dataset says what was found: its folder, that its layout is whole, its images and classes,
and its size on disk. A dataset that is absent without data.download, or only partly there, is
refused with the line a run refuses it with, before anything is downloaded.

`fl-lightning sweep` checks a plan's datasets so too (`check_datasets`), before anything of it runs,
is submitted or timed, reading and downloading nothing: a grid whose data is not there would fail
in every run, after its allocation waited in the queue.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from fl_lightning.cli.parser import parse_command_line
from fl_lightning.data.datasets import (
    DIGITS_FILE,
    LAYOUTS,
    TINY_IMAGENET_CACHE,
    ImageDataset,
    check_dataset,
    load_dataset,
)
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.plans.resolve import (
    PlanRefused,
    ResolvedPoint,
    check_grid,
    describe_point,
    fit_parser,
    resolve_grid,
)

DatasetSettings = tuple[str, Path, bool]
"""data.name, data.root and data.download of a run."""
ALGORITHM_FOR_THE_DATA = "fedavg"
"""Given first on a fit line whose data is read: fit requires an algorithm, the data does not, and one
in the line's config files or options replaces it."""


def data(plan: Optional[Union[str, list[str]]] = None, override: Optional[list[str]] = None) -> None:
    """Download (with data.download) and check the datasets of sweep plans (`data PLAN [PLAN ...]`) or of
    a fit command line (`data --config FILE [--group.field value ...]`), without training.

    Prints, per dataset, its folder, layout, images, classes and size on disk.

    Args:
        plan: the plan file(s) whose grid points' datasets (data.name, data.root, data.download) to prepare.
        override: KEY=VALUE settings applied last to every grid point, as for sweep (repeat --override for
            several), e.g. data.download=true or data.root=/scratch/data.
    """
    if plan is None:
        raise ConfigError("plan", "a plan file (fl-lightning data PLAN) or a fit command line (fl-lightning data "
                          "--config FILE ...)", None)
    wanted = []
    for path in [plan] if isinstance(plan, str) else plan:
        resolved = resolve_grid(load_plan(Path(path), overrides=override).grid())
        check_grid(Path(path), resolved)
        wanted += [(entry.config["data"]["name"], Path(entry.config["data"]["root"]),
                    entry.config["data"]["download"]) for entry in resolved]
    prepare_datasets(wanted)


def fit_line_of(argv: list[str]) -> Optional[list[str]]:
    """The fit arguments of `fl-lightning data --config FILE ...` (argv without the program name); None
    for any other command line, `data PLAN`, `data --plan PLAN` and `data --help` among them. A line with
    a plan and --config both is returned too: `data_of_fit_line` refuses it (read as a plan's, it would
    have the config file's fields refused as the data command's)."""
    if argv[:1] != ["data"] or len(argv) == 1:
        return None
    if any(arg.partition("=")[0] == "--config" for arg in argv[1:]):
        return argv[1:]
    first = argv[1].partition("=")[0].rstrip("+")
    if not first.startswith("-") or first in ("--plan", "--override", "--help", "-h"):
        return None
    return argv[1:]


def data_of_fit_line(arguments: list[str]) -> None:
    """`fl-lightning data` of a fit command line's arguments: the dataset its run would read."""
    plans = [arg for position, arg in enumerate(arguments) if position == 0 and not arg.startswith("-")]
    plans += [value for option, value in zip(arguments, arguments[1:]) if option == "--plan"]
    plans += [arg.partition("=")[2] for arg in arguments if arg.startswith("--plan=")]
    if plans:
        raise ConfigError("plan", "a plan (fl-lightning data PLAN) or a fit command line (fl-lightning data "
                          "--config FILE ...), not both", f"{' '.join(plans)} and --config")
    parser = fit_parser()
    settings = parse_command_line(["fit", "--algorithm", ALGORITHM_FOR_THE_DATA, *arguments], parser)
    chosen = parser.instantiate(settings).fit["data"]
    prepare_datasets([(chosen.name, Path(chosen.root), chosen.download)])


def prepare_datasets(wanted: list[DatasetSettings]) -> None:
    """Each distinct dataset of `wanted` (downloaded where any run of it downloads) checked, refused
    before anything is fetched if one is missing, then fetched where absent, read and described."""
    downloads: dict[tuple[str, Path], bool] = {}
    for name, root, download in wanted:
        downloads[name, root] = downloads.get((name, root), False) or download
    for (name, root), download in downloads.items():
        problem = check_dataset(name, root, download).problem
        if problem is not None:
            raise problem
    for (name, root), download in downloads.items():
        train, test = load_dataset(name, root, download)
        print(describe_dataset(name, root, train, test), flush=True)


def check_datasets(plan: Path, resolved: list[ResolvedPoint]) -> None:
    """Refuse the plan when a dataset of its points is missing from its data.root, or there in part
    (`check_dataset`: each distinct dataset once, the names of its layout, no file read), one line per
    dataset with the points that need it; one that a point downloads (data.download) may be absent."""
    needed: dict[tuple[str, Path], list[ResolvedPoint]] = {}
    for entry in resolved:
        needed.setdefault((entry.config["data"]["name"], Path(entry.config["data"]["root"])), []).append(entry)
    problems = []
    for (name, root), entries in needed.items():
        problem = check_dataset(name, root, any(entry.config["data"]["download"] for entry in entries)).problem
        if problem is not None:
            first = entries[0].point
            problems.append(f"{name} for {len(entries)} point(s), first [{first.index}] {describe_point(first)}: "
                            f"{problem}")
    if problems:
        raise PlanRefused("data.root", "the dataset of every grid point in its layout under its data.root before "
                          "anything runs or is submitted (put it there, fetch it with fl-lightning data, or set "
                          "data.download: true where the runs can reach the network)", plan, problems)


def describe_dataset(name: str, root: Path, train: ImageDataset, test: ImageDataset) -> str:
    """`cifar10: data/cifar-10-batches-py/ holds data_batch_1..5 and test_batch (...): layout OK; 40000
    train and 10000 test images of 3x32x32, 10 classes; 154.4 MB on disk`"""
    shape = "x".join(str(size) for size in train.images.shape[1:])
    images = f"{len(train)} train and {len(test)} test images of {shape}, {train.num_classes} classes"
    if name == "digits":
        return f"digits: bundled with fl-lightning ({DIGITS_FILE.name}): {images}"
    if name not in LAYOUTS:
        return f"{name}: your loader, with data.root {root}: {images}"
    layout = LAYOUTS[name]
    folder = root / layout.folder
    held = f"{layout.description}: layout OK"
    if layout.lacking(folder):  # Tiny-ImageNet read from its cache alone
        held = f"its decoded images ({TINY_IMAGENET_CACHE}), without the JPEG layout"
    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    return f"{name}: {folder}/ holds {held}; {images}; {size / 1e6:.1f} MB on disk"
