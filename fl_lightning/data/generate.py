"""Small synthetic datasets written in the real on-disk formats, for tests and benchmarks.

Every class has its own mean colour and stripe orientation and frequency; each image adds a
random stripe phase and pixel noise. A small model therefore learns them well above chance.
"""

from __future__ import annotations

import pickle
import tarfile
import zipfile
from pathlib import Path

import numpy as np

CIFAR_VARIANTS = {"cifar10": ("cifar-10-batches-py", 10), "cifar100": ("cifar-100-python", 100)}
# Bounds the float working memory when tens of thousands of images are asked for.
IMAGES_PER_CHUNK = 4096


def _class_images(labels: np.ndarray, num_classes: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [N, 3, size, size] images whose look depends on their label."""
    colours = rng.uniform(50, 205, (num_classes, 3)).astype(np.float32)
    angles = rng.uniform(0, np.pi, num_classes).astype(np.float32)
    frequencies = rng.uniform(1, 4, num_classes).astype(np.float32)  # stripes per image width
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size

    images = np.empty((len(labels), 3, size, size), dtype=np.uint8)
    for start in range(0, len(labels), IMAGES_PER_CHUNK):
        chunk = labels[start:start + IMAGES_PER_CHUNK]
        phases = rng.uniform(0, 2 * np.pi, len(chunk)).astype(np.float32)
        direction = (x * np.cos(angles[chunk])[:, None, None] + y * np.sin(angles[chunk])[:, None, None])
        stripes = 40 * np.sin(2 * np.pi * frequencies[chunk][:, None, None] * direction + phases[:, None, None])
        noise = rng.normal(0, 25, (len(chunk), 3, size, size)).astype(np.float32)
        pixels = colours[chunk][:, :, None, None] + stripes[:, None] + noise
        images[start:start + len(chunk)] = np.clip(np.rint(pixels), 0, 255)
    return images


def _balanced_labels(count: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(np.arange(count) % num_classes)


def write_cifar(root: Path, variant: str = "cifar10", num_train: int = 500, num_test: int = 100, seed: int = 0) -> Path:
    """Writes root/cifar-10-batches-py (data_batch_1..5, test_batch, batches.meta) or
    root/cifar-100-python (train, test, meta) as pickles with bytes keys; returns the folder."""
    if variant not in CIFAR_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(CIFAR_VARIANTS)}, got {variant!r}")
    folder_name, num_classes = CIFAR_VARIANTS[variant]
    folder = Path(root) / folder_name
    folder.mkdir(parents=True, exist_ok=True)

    rng = np.random.default_rng(seed)
    train_labels = _balanced_labels(num_train, num_classes, rng)
    test_labels = _balanced_labels(num_test, num_classes, rng)
    images = _class_images(np.concatenate([train_labels, test_labels]), num_classes, 32, rng)
    train_images, test_images = images[:num_train], images[num_train:]

    label_key = b"labels" if variant == "cifar10" else b"fine_labels"

    def batch(images: np.ndarray, labels: np.ndarray, name: str, first_index: int) -> dict:
        contents = {
            b"batch_label": name.encode(),
            label_key: [int(label) for label in labels],
            b"data": images.reshape(len(images), 3 * 32 * 32),  # rows of R, then G, then B planes
            b"filenames": [f"synthetic_{first_index + i:06d}.png".encode() for i in range(len(images))],
        }
        if variant == "cifar100":
            contents[b"coarse_labels"] = [int(label) // 5 for label in labels]
        return contents

    if variant == "cifar10":
        starts = np.linspace(0, num_train, 6).astype(int)
        for number, (start, stop) in enumerate(zip(starts[:-1], starts[1:]), start=1):
            _dump(folder / f"data_batch_{number}",
                  batch(train_images[start:stop], train_labels[start:stop], f"training batch {number} of 5", start))
        _dump(folder / "test_batch", batch(test_images, test_labels, "testing batch 1 of 1", num_train))
        _dump(folder / "batches.meta", {
            b"label_names": [f"class_{label}".encode() for label in range(num_classes)],
            b"num_cases_per_batch": int(starts[1]),
            b"num_vis": 3 * 32 * 32,
        })
    else:
        _dump(folder / "train", batch(train_images, train_labels, "training batch 1 of 1", 0))
        _dump(folder / "test", batch(test_images, test_labels, "testing batch 1 of 1", num_train))
        _dump(folder / "meta", {
            b"fine_label_names": [f"class_{label}".encode() for label in range(num_classes)],
            b"coarse_label_names": [f"superclass_{label}".encode() for label in range(num_classes // 5)],
        })
    return folder


def _dump(path: Path, contents: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(contents, f, protocol=2)


def write_tiny_imagenet(
    root: Path, num_classes: int = 3, train_per_class: int = 4, val_per_class: int = 2, seed: int = 0
) -> Path:
    """Writes root/tiny-imagenet-200 with 64x64 JPEGs in the standard layout; returns the folder.

    wnids.txt lists the classes in descending order, so a loader that sorts folder names instead
    of reading wnids.txt gets the labels wrong. The first training image is greyscale, as a few
    real ones are.
    """
    from PIL import Image

    folder = Path(root) / "tiny-imagenet-200"
    rng = np.random.default_rng(seed)
    wnids = [f"n{number:08d}" for number in sorted(rng.choice(10**8, num_classes, replace=False), reverse=True)]
    train_labels = np.repeat(np.arange(num_classes), train_per_class)
    val_labels = _balanced_labels(num_classes * val_per_class, num_classes, rng)
    images = _class_images(np.concatenate([train_labels, val_labels]), num_classes, 64, rng)

    def save(pixels: np.ndarray, path: Path, mode: str = "RGB") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.transpose(1, 2, 0)).convert(mode).save(path, format="JPEG", quality=90)

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wnids.txt").write_text("".join(f"{wnid}\n" for wnid in wnids))
    (folder / "words.txt").write_text("".join(f"{wnid}\tsynthetic class {label}\n" for label, wnid in enumerate(wnids)))

    for index, label in enumerate(train_labels):
        wnid = wnids[label]
        filename = f"{wnid}_{index % train_per_class}.JPEG"
        save(images[index], folder / "train" / wnid / "images" / filename, "L" if index == 0 else "RGB")
    for wnid in wnids:
        (folder / "train" / wnid).mkdir(parents=True, exist_ok=True)
        (folder / "train" / wnid / f"{wnid}_boxes.txt").write_text(
            "".join(f"{wnid}_{i}.JPEG\t0\t0\t63\t63\n" for i in range(train_per_class))
        )

    annotations = []
    for index, label in enumerate(val_labels):
        filename = f"val_{index}.JPEG"
        save(images[len(train_labels) + index], folder / "val" / "images" / filename)
        annotations.append(f"{filename}\t{wnids[label]}\t0\t0\t63\t63\n")
    (folder / "val" / "val_annotations.txt").write_text("".join(annotations))
    return folder


def write_archive(folder: Path, archive: Path) -> Path:
    """Packs the dataset folder `folder` (as written above) the way its published archive is packed,
    every entry under the folder's own name: a .tar.gz (CIFAR's) or a .zip (Tiny-ImageNet's), as
    `archive` ends. Returns `archive`."""
    folder, archive = Path(folder), Path(archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    if archive.name.endswith(".tar.gz"):
        with tarfile.open(archive, "w:gz") as packed:
            packed.add(folder, arcname=folder.name)
    elif archive.suffix == ".zip":
        with zipfile.ZipFile(archive, "w") as packed:
            for path in sorted(folder.rglob("*")):
                packed.write(path, path.relative_to(folder.parent))
    else:
        raise ValueError(f"archive must end in .tar.gz or .zip, got {archive.name!r}")
    return archive
