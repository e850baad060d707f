"""Image datasets as whole uint8 tensors, read from their standard on-disk layouts."""

from __future__ import annotations

import os
import pickle
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fl_lightning.config import ConfigError


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


DATASET_NAMES = ("cifar10", "cifar100", "tiny_imagenet", "digits")

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


def load_dataset(name: str, root: Path, download: bool = False) -> tuple[ImageDataset, ImageDataset]:
    """The (train, test) splits of `name`; for tiny_imagenet the test split is the labelled val set."""
    loaders = {
        "cifar10": _load_cifar10,
        "cifar100": _load_cifar100,
        "tiny_imagenet": _load_tiny_imagenet,
        "digits": _load_digits,
    }
    if name not in loaders:
        raise ConfigError("data.name", f"one of {', '.join(DATASET_NAMES)}", name)
    return loaders[name](Path(root), download)


def _missing_dataset(root: Path, folder: Path, layout: str) -> ConfigError:
    return ConfigError("data.root", f"{folder}/ to hold {layout} (or set data.download: true)", str(root))


def _download(url: str, root: Path, fetch) -> None:
    """Run `fetch` (a torchvision download of `url` into root); any failure becomes a ConfigError
    naming data.download and the URL, since offline that is the usual cause."""
    try:
        fetch()
    except Exception as err:  # urllib, socket, checksum and file-system errors alike
        raise ConfigError(
            "data.download",
            f"a network connection to download {url} into {root} (or the dataset already there)",
            f"{type(err).__name__}: {err}",
        ) from err


def _require_files(root: Path, folder: Path, names: tuple[str, ...], layout: str, download: bool,
                   url: str, fetch) -> None:
    """Every file of the layout must be there: a partial copy would silently train on less data."""

    def missing() -> list[str]:
        return [name for name in names if not (folder / name).is_file()]

    if missing() and download:
        _download(url, root, fetch)
    absent = missing()
    if len(absent) == len(names):
        raise _missing_dataset(root, folder, layout)
    if absent:
        raise ConfigError("data.root", f"{folder}/ to hold {layout}",
                          f"{root}, whose {folder.name}/ lacks {', '.join(absent)}")


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


def _load_cifar10(root: Path, download: bool) -> tuple[ImageDataset, ImageDataset]:
    folder = root / "cifar-10-batches-py"

    def fetch() -> None:
        import torchvision

        torchvision.datasets.CIFAR10(str(root), train=True, download=True)

    _require_files(root, folder, (*CIFAR10_TRAIN_FILES, "test_batch"),
                   "data_batch_1..5 and test_batch (CIFAR-10, python version)", download, CIFAR10_URL, fetch)
    return (
        _cifar_split([folder / name for name in CIFAR10_TRAIN_FILES], "labels", 10, CIFAR10_MEAN, CIFAR10_STD),
        _cifar_split([folder / "test_batch"], "labels", 10, CIFAR10_MEAN, CIFAR10_STD),
    )


def _load_cifar100(root: Path, download: bool) -> tuple[ImageDataset, ImageDataset]:
    folder = root / "cifar-100-python"

    def fetch() -> None:
        import torchvision

        torchvision.datasets.CIFAR100(str(root), train=True, download=True)

    _require_files(root, folder, ("train", "test"), "train and test (CIFAR-100, python version)", download,
                   CIFAR100_URL, fetch)
    return (
        _cifar_split([folder / "train"], "fine_labels", 100, CIFAR100_MEAN, CIFAR100_STD),
        _cifar_split([folder / "test"], "fine_labels", 100, CIFAR100_MEAN, CIFAR100_STD),
    )


def _load_tiny_imagenet(root: Path, download: bool) -> tuple[ImageDataset, ImageDataset]:
    """Decodes the JPEGs once and keeps them in a cache file; delete it to decode again."""
    folder = root / "tiny-imagenet-200"
    cache = folder / TINY_IMAGENET_CACHE
    if not cache.is_file():
        has_layout = all(
            (folder / part).exists() for part in ("wnids.txt", "train", "val/val_annotations.txt")
        )
        if not has_layout:
            if not download:
                raise _missing_dataset(
                    root, folder, "wnids.txt, train/<wnid>/images/*.JPEG and val/ with val_annotations.txt"
                )
            from torchvision.datasets.utils import download_and_extract_archive

            _download(TINY_IMAGENET_URL, root, lambda: download_and_extract_archive(TINY_IMAGENET_URL, str(root)))
        _write_atomically(_decode_tiny_imagenet(folder), cache)
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


def _write_atomically(obj: dict, path: Path) -> None:
    # A run killed mid-write must not leave a truncated cache that later runs would trust.
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as f:
            torch.save(obj, f)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _load_digits(root: Path, download: bool) -> tuple[ImageDataset, ImageDataset]:
    """scikit-learn's bundled 8x8 digits (values 0..16), split 80/20 by class; root is not used."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.clip(digits.images * 16, 0, 255).astype(np.uint8)[:, None]
    labels = digits.target.astype(np.int64)
    train_images, test_images, train_labels, test_labels = train_test_split(
        images, labels, test_size=0.2, stratify=labels, random_state=0
    )
    mean = (float(train_images.mean() / 255),)
    std = (float((train_images / 255).std()),)
    return (
        ImageDataset(torch.from_numpy(np.ascontiguousarray(train_images)),
                     torch.from_numpy(train_labels), 10, mean, std),
        ImageDataset(torch.from_numpy(np.ascontiguousarray(test_images)),
                     torch.from_numpy(test_labels), 10, mean, std),
    )
