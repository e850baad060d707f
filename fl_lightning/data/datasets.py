"""Image datasets as whole uint8 tensors, read from their standard on-disk layouts.

`data.name` is a built-in dataset (`DATASET_NAMES`: cifar10, cifar100, tiny_imagenet, digits) or a
loader of the user's by dotted path, `module.function` (or `module.Class`), importable from
`sys.path` (e.g. `data.name: my_dataset.load_my_dataset` with `PYTHONPATH=examples`). A loader is
called with keywords only, as

    loader(root=data.root, download=data.download)

with `root` a `pathlib.Path` and `download` a bool, and returns the pair `(train, test)` of
`ImageDataset`s (train: the split the clients share; test: the split the global model is
evaluated on). Each split holds

- `images`: a uint8 tensor [N, C, H, H] (square images, values 0..255, on the CPU);
- `labels`: an int64 tensor [N] of class indices 0 .. num_classes - 1;
- `num_classes`: the same int in both splits;
- `mean`, `std`: C floats each, per-channel statistics of images / 255 (usually of the training
  split), which normalise every batch on the device.

Both splits need the same C and H. `load_dataset` checks all of this and raises a `ConfigError`
naming data.name for anything else; a loader reports a missing or unreadable dataset with a
`ConfigError` naming data.root, as the built-in ones do.

The built-in datasets read from data.root (`LAYOUTS`) are downloaded, extracted and decoded by one
process at a time of all those that share data.root (fl_lightning.data.download); `check_dataset`
tells, from file names alone, whether a run would find one whole, download it or refuse it.
"""

from __future__ import annotations

import inspect
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional, get_args

import numpy as np
import torch

from fl_lightning.atomic_files import write_atomically
from fl_lightning.choices import DatasetName
from fl_lightning.configurable import missing_module, resolve_dotted_path, why_unresolved
from fl_lightning.data.download import DatasetLock, fetch_folder
from fl_lightning.errors import ConfigError
from fl_lightning.registry import Registry


@dataclass
class ImageDataset:
    """A whole split in memory: images uint8 [N, C, H, W] and labels int64 [N], on the CPU."""

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    """Per-channel mean of images / 255."""
    std: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.labels)


DatasetLoader = Callable[..., "tuple[ImageDataset, ImageDataset]"]
_dataset_loaders: Registry[DatasetLoader] = Registry("dataset")


def register_dataset(name: str, label: Optional[str] = None) -> Callable[[DatasetLoader], DatasetLoader]:
    """Register a built-in dataset's loader, called as loader(root, download), under `name`, labelled
    `label` in tables (as models register: fl_lightning.models.register_model). A dataset of your own
    needs no entry: its loader is named by its dotted path (docs/extending.md)."""
    return _dataset_loaders.register(name, label)


def dataset_label(name: str) -> str:
    """How a table names the dataset `name` (CIFAR-10 for cifar10); a name not registered as it is given."""
    return _dataset_loaders.label(name) or name


def registered_datasets() -> list[str]:
    """The built-in datasets' names, in registration order."""
    return _dataset_loaders.names()


DATASET_NAMES = get_args(DatasetName)
"""The built-in datasets, as the settings' type names them (the registry holds the same: tested)."""

# Published per-pixel statistics of the training splits, so every run normalises alike.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
TINY_IMAGENET_MEAN = (0.4802, 0.4481, 0.3975)
TINY_IMAGENET_STD = (0.2770, 0.2691, 0.2821)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{number}" for number in range(1, 6))
TINY_IMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINY_IMAGENET_CACHE = "fl_lightning_cache.pt"
TINY_IMAGENET_SIZE = 64


@dataclass(frozen=True)
class DatasetLayout:
    """Where a built-in dataset lies under data.root, what its folder must hold, and the archive it
    is downloaded as (which unpacks to that folder)."""

    folder: str
    entries: tuple[str, ...]
    """Files and folders the folder must hold, every one: a partial copy would silently train on less data."""
    description: str
    url: str
    md5: Optional[str]
    """Of the archive, as published."""

    def lacking(self, folder: Path) -> list[str]:
        return [entry for entry in self.entries if not (folder / entry).exists()]


LAYOUTS = {
    "cifar10": DatasetLayout("cifar-10-batches-py", (*CIFAR10_TRAIN_FILES, "test_batch"),
                             "data_batch_1..5 and test_batch (CIFAR-10, python version)", CIFAR10_URL,
                             "c58f30108f718f92721af3b95e74349a"),
    "cifar100": DatasetLayout("cifar-100-python", ("train", "test"), "train and test (CIFAR-100, python version)",
                              CIFAR100_URL, "eb9058c3a382ffc7106e4002c42a8d85"),
    "tiny_imagenet": DatasetLayout("tiny-imagenet-200", ("wnids.txt", "train", "val/val_annotations.txt"),
                                   "wnids.txt, train/<wnid>/images/*.JPEG and val/ with val_annotations.txt",
                                   TINY_IMAGENET_URL, "90528d7ca1a48142e341f4ef8d21d0de"),
}
"""The built-in datasets read from data.root (digits is bundled)."""


LOADER_RETURNS = (
    "a loader returning the pair (train, test) of ImageDatasets: uint8 images [N, C, H, H], int64 labels [N] "
    "below num_classes, C means and stds"
)


def load_dataset(name: str, root: Path, download: bool = False) -> tuple[ImageDataset, ImageDataset]:
    """The (train, test) splits of `name`: a built-in dataset (for tiny_imagenet the test split is the
    labelled val set) or a loader by dotted path (see the module docstring)."""
    loader = _dataset_loaders.get(name)
    if loader is not None:
        return loader(Path(root), download)
    loader = dataset_loader(name)
    return _check_splits(name, loader(root=Path(root), download=download))


def check_dataset_name(name: str) -> None:
    """Raise the `ConfigError` that `load_dataset` would raise for an unknown `name` or an
    unusable loader, without loading anything: `DataArgs` calls it, so a bad name fails while the
    settings are read."""
    if name not in DATASET_NAMES:
        dataset_loader(name)


def dataset_loader(name: str) -> DatasetLoader:
    """The user's loader that the dotted path `name` points to, checked to be a callable taking
    `root` and `download`; a ConfigError naming data.name otherwise (a plain name that is not a
    built-in dataset lists the built-in ones)."""
    if "." not in name:
        raise ConfigError("data.name", f"one of {', '.join(DATASET_NAMES)}", name)
    try:
        loader = resolve_dotted_path(name)
    except Exception as err:  # AttributeError, or anything the user's module raises on import
        expected = "an importable dataset loader as module.function"
        if missing_module(name, err):
            expected = f"one of {', '.join(DATASET_NAMES)} or {expected}"
        raise ConfigError("data.name", expected, why_unresolved(name, err)) from err
    if not callable(loader):
        raise ConfigError("data.name", "a callable dataset loader (a function or class) at that dotted path",
                          f"{name}, of type {type(loader).__name__}")
    try:
        signature = inspect.signature(loader)
    except (TypeError, ValueError):  # no signature to read: the call will tell
        return loader
    try:
        signature.bind(root=Path("."), download=False)
    except TypeError as err:
        raise ConfigError("data.name", "a dataset loader taking the keyword arguments root and download",
                          f"{name}{signature}") from err
    return loader


def _check_splits(name: str, splits: object) -> tuple[ImageDataset, ImageDataset]:
    """A loader's result must be what the built-in loaders return; a mistake found here names the
    loader, where it would otherwise surface as a shape error deep inside training."""
    def refuse(problem: str) -> ConfigError:
        return ConfigError("data.name", LOADER_RETURNS, f"{name}, which returned {problem}")

    if not isinstance(splits, (tuple, list)) or len(splits) != 2:
        length = f" of length {len(splits)}" if isinstance(splits, (tuple, list)) else ""
        raise refuse(f"a value of type {type(splits).__name__}{length}")
    for split, dataset in zip(("train", "test"), splits):
        if not isinstance(dataset, ImageDataset):
            raise refuse(f"a value of type {type(dataset).__name__} as the {split} split")
        images, labels = dataset.images, dataset.labels
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4 \
                or images.shape[2] != images.shape[3]:
            raise refuse(f"{split} images of {_describe(images)}")
        if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.shape != images.shape[:1]:
            raise refuse(f"{split} labels of {_describe(labels)} for {len(images)} images")
        num_classes = dataset.num_classes
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise refuse(f"{split} num_classes {num_classes!r}")
        if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
            raise refuse(f"{split} labels from {int(labels.min())} to {int(labels.max())} for num_classes "
                         f"{num_classes}")
        channels = images.shape[1]
        statistics = (dataset.mean, dataset.std)
        if not all(isinstance(s, (tuple, list)) and len(s) == channels for s in statistics) \
                or min(dataset.std) <= 0:
            raise refuse(f"{split} mean {dataset.mean!r} and std {dataset.std!r} for {channels} channel(s)")
        if len(labels) == 0:
            raise refuse(f"an empty {split} split")
    train, test = splits
    if train.images.shape[1:] != test.images.shape[1:] or train.num_classes != test.num_classes:
        raise refuse(f"train images {tuple(train.images.shape[1:])} with {train.num_classes} classes but test "
                     f"images {tuple(test.images.shape[1:])} with {test.num_classes}")
    return train, test


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return f"type {type(value).__name__}"


DatasetState = Literal["present", "to download", "missing", "bundled", "not looked into"]


@dataclass
class DatasetCheck:
    """What data.root holds of one dataset, found without reading its files (`check_dataset`)."""

    name: str
    folder: Optional[Path]
    """The dataset's folder; None for digits (bundled) and for a loader of the user's."""
    state: DatasetState
    """present: whole in its layout (tiny_imagenet: or decoded in its cache); to download: absent, with
    download; missing: absent without download, or only part of its layout there (which a download does
    not replace); not looked into: a loader of the user's, which only its call can check."""
    problem: Optional[ConfigError] = None
    """What a run refuses the dataset with (state missing): one line naming the folder and its layout."""


def check_dataset(name: str, root: Path, download: bool = False) -> DatasetCheck:
    """What root holds of the dataset `name`: whether a run with data.root `root` and data.download
    `download` would find it whole in its layout, download it, or refuse it (and with what error).
    Looks at names only, reading no file: cheap enough for every dataset of a plan."""
    if name == "digits":
        return DatasetCheck(name, None, "bundled")
    if name not in LAYOUTS:
        return DatasetCheck(name, None, "not looked into")
    layout, root = LAYOUTS[name], Path(root)
    folder = root / layout.folder
    absent = layout.lacking(folder)
    if not absent or (name == "tiny_imagenet" and (folder / TINY_IMAGENET_CACHE).is_file()):
        return DatasetCheck(name, folder, "present")
    if len(absent) < len(layout.entries):
        replace = " (data.download does not replace a folder: remove it to download the dataset again)"
        return DatasetCheck(name, folder, "missing", ConfigError(
            "data.root", f"{folder}/ to hold {layout.description}",
            f"{root}, whose {folder.name}/ lacks {', '.join(absent)}{replace if download else ''}"))
    if download:
        return DatasetCheck(name, folder, "to download")
    return DatasetCheck(name, folder, "missing", ConfigError(
        "data.root", f"{folder}/ to hold {layout.description} (or set data.download: true)", str(root)))


def _prepared_folder(name: str, root: Path, download: bool, ready: Callable[[], bool],
                     prepare: Callable[[], None] = lambda: None) -> Path:
    """The dataset's folder under root once `ready()` holds. Until it does, one process at a time of
    all those sharing root (the DatasetLock) downloads what is absent (with `download`) and runs
    `prepare`; the others wait for it, then find the dataset ready. A dataset that is missing is the
    ConfigError of `check_dataset`."""
    layout = LAYOUTS[name]
    if not ready():
        check = check_dataset(name, root, download)
        if check.problem is not None:
            raise check.problem
        with DatasetLock(root, layout.folder):
            if not ready():
                if check_dataset(name, root, download).state == "to download":
                    fetch_folder(layout.url, layout.md5, root, layout.folder, layout.lacking, layout.description)
                # What is there now, fetched or not, must be whole.
                check = check_dataset(name, root)
                if check.problem is not None:
                    raise check.problem
                prepare()
    return root / layout.folder


def _read_cifar_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        # The official files unpickle with bytes keys; copies re-pickled under Python 3 may use str.
        batch = {key.decode() if isinstance(key, bytes) else key: value for key, value in batch.items()}
        images = np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(batch[label_key], dtype=np.int64)
    except Exception as err:  # garbage or truncated bytes raise anything from UnpicklingError to KeyError
        raise ConfigError(
            "data.root", f"{path.name} to be a CIFAR batch (a python pickle with data and {label_key})",
            f"{path}, unreadable ({type(err).__name__}: {err})",
        ) from err
    if labels.shape != (len(images),):
        raise ConfigError("data.root", f"{path.name} to hold one label per image",
                          f"{path} with {len(images)} images and {labels.size} labels")
    return images, labels


def _cifar_split(paths: list[Path], label_key: str, num_classes: int, mean, std) -> ImageDataset:
    batches = [_read_cifar_batch(path, label_key) for path in paths]
    images = np.concatenate([images for images, _ in batches])
    labels = np.concatenate([labels for _, labels in batches])
    return ImageDataset(torch.from_numpy(images), torch.from_numpy(labels), num_classes, mean, std)


def _whole_folder(name: str, root: Path, download: bool) -> Path:
    layout = LAYOUTS[name]
    return _prepared_folder(name, root, download, lambda: not layout.lacking(root / layout.folder))


@register_dataset("cifar10", label="CIFAR-10")
def _load_cifar10(root: Path, download: bool) -> tuple[ImageDataset, ImageDataset]:
    folder = _whole_folder("cifar10", root, download)
    return (
        _cifar_split([folder / name for name in CIFAR10_TRAIN_FILES], "labels", 10, CIFAR10_MEAN, CIFAR10_STD),
        _cifar_split([folder / "test_batch"], "labels", 10, CIFAR10_MEAN, CIFAR10_STD),
    )


@register_dataset("cifar100", label="CIFAR-100")
def _load_cifar100(root: Path, download: bool) -> tuple[ImageDataset, ImageDataset]:
    folder = _whole_folder("cifar100", root, download)
    return (
        _cifar_split([folder / "train"], "fine_labels", 100, CIFAR100_MEAN, CIFAR100_STD),
        _cifar_split([folder / "test"], "fine_labels", 100, CIFAR100_MEAN, CIFAR100_STD),
    )


@register_dataset("tiny_imagenet", label="Tiny-ImageNet")
def _load_tiny_imagenet(root: Path, download: bool) -> tuple[ImageDataset, ImageDataset]:
    """Decodes the JPEGs once, in one process of all those sharing root, and keeps them in a cache
    file; delete it to decode again."""
    cache = root / LAYOUTS["tiny_imagenet"].folder / TINY_IMAGENET_CACHE

    def decode() -> None:
        decoded = _decode_tiny_imagenet(cache.parent)
        # A run killed mid-write must not leave a truncated cache that later runs would trust.
        write_atomically(cache, lambda file: torch.save(decoded, file))

    _prepared_folder("tiny_imagenet", root, download, cache.is_file, decode)
    tensors = torch.load(cache, weights_only=True)
    num_classes = len(tensors["wnids"])
    return (
        ImageDataset(tensors["train_images"], tensors["train_labels"], num_classes,
                     TINY_IMAGENET_MEAN, TINY_IMAGENET_STD),
        ImageDataset(tensors["test_images"], tensors["test_labels"], num_classes,
                     TINY_IMAGENET_MEAN, TINY_IMAGENET_STD),
    )


def _decode_tiny_imagenet(folder: Path) -> dict:
    wnids = (folder / "wnids.txt").read_text().split()
    label_of = {wnid: label for label, wnid in enumerate(wnids)}

    train_paths, train_labels = [], []
    for label, wnid in enumerate(wnids):
        paths = sorted((folder / "train" / wnid / "images").glob("*.JPEG"))
        train_paths += paths
        train_labels += [label] * len(paths)

    test_paths, test_labels = [], []
    for line in (folder / "val" / "val_annotations.txt").read_text().splitlines():
        if line.strip():
            filename, wnid = line.split("\t")[:2]
            test_paths.append(folder / "val" / "images" / filename)
            test_labels.append(label_of[wnid])

    return {
        "wnids": wnids,
        "train_images": _decode_jpegs(train_paths),
        "train_labels": torch.tensor(train_labels, dtype=torch.int64),
        "test_images": _decode_jpegs(test_paths),
        "test_labels": torch.tensor(test_labels, dtype=torch.int64),
    }


def _decode_jpegs(paths: list[Path]) -> torch.Tensor:
    from PIL import Image

    size = TINY_IMAGENET_SIZE
    images = np.empty((len(paths), 3, size, size), dtype=np.uint8)

    def decode_into(index: int) -> None:
        with Image.open(paths[index]) as image:
            pixels = np.asarray(image.convert("RGB"))  # a few Tiny-ImageNet images are greyscale
        if pixels.shape != (size, size, 3):
            raise ConfigError("data.root", f"{size}x{size} images", f"{paths[index]} of shape {pixels.shape}")
        images[index] = pixels.transpose(2, 0, 1)

    # Pillow releases the GIL while decoding, so threads use every core.
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        for _ in pool.map(decode_into, range(len(paths))):
            pass
    return torch.from_numpy(images)


DIGITS_FILE = Path(__file__).with_name("digits.npz")


@register_dataset("digits")
def _load_digits(root: Path, download: bool) -> tuple[ImageDataset, ImageDataset]:
    """The 8x8 handwritten digits bundled with fl-lightning (values 0..16 scaled to 0..255), split
    80/20 by class; root is not used.

    They are the test set of the UCI "Optical Recognition of Handwritten Digits" data (E. Alpaydin and
    C. Kaynak, 1998; CC BY 4.0): 1,797 images, as scikit-learn bundles them (`load_digits`). digits.npz
    holds them split as scikit-learn 1.9's `train_test_split(images, labels, test_size=0.2,
    stratify=labels, random_state=0)` splits them, in its order. The split is stored, not computed, so
    that a run needs no scikit-learn, and no SciPy: torchmetrics, which every run imports, imports
    scipy.signal whenever it is installed (about 1.5 CPU s of each run's start-up)."""
    with np.load(DIGITS_FILE) as digits:
        parts = [(digits[f"{part}_images"], digits[f"{part}_labels"]) for part in ("train", "test")]
    (train_images, train_labels), (test_images, test_labels) = [
        (np.minimum(values.astype(np.int64) * 16, 255).astype(np.uint8)[:, None], labels.astype(np.int64))
        for values, labels in parts
    ]
    mean = (float(train_images.mean() / 255),)
    std = (float((train_images / 255).std()),)
    return (
        ImageDataset(torch.from_numpy(train_images), torch.from_numpy(train_labels), 10, mean, std),
        ImageDataset(torch.from_numpy(test_images), torch.from_numpy(test_labels), 10, mean, std),
    )
