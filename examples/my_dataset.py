"""A dataset of your own: `--data.name my_dataset.load_shapes` (with this folder on PYTHONPATH).

fl-lightning calls the loader with keywords only, as `load_shapes(root=data.root,
download=data.download)`, and expects the pair (train, test) of `ImageDataset`s: uint8 images
[N, C, H, H], int64 labels [N] in 0 .. num_classes - 1, and per-channel mean and std of images / 255.

The shapes are drawn here, so the example needs no files; a real loader reads them from `root`
(and, when they are missing, raises `ConfigError("data.root", "<the layout expected>", str(root))`).
"""

from pathlib import Path

import numpy as np
import torch

from fl_lightning.data import ImageDataset

SIZE = 16
CLASSES = ("horizontal bar", "vertical bar", "square", "cross")


def draw_shapes(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` noisy RGB images [count, 3, SIZE, SIZE], each one shape in a random colour and place."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 60, size=(count, 3, SIZE, SIZE))
    labels = rng.integers(0, len(CLASSES), size=count)
    for image, label in zip(images, labels):
        row, col = rng.integers(2, SIZE - 10, size=2)
        mask = np.zeros((SIZE, SIZE), dtype=bool)
        if label in (0, 3):
            mask[row + 3:row + 5, col:col + 8] = True
        if label in (1, 3):
            mask[row:row + 8, col + 3:col + 5] = True
        if label == 2:
            mask[row:row + 8, col:col + 8] = True
            mask[row + 2:row + 6, col + 2:col + 6] = False
        image[:, mask] = rng.integers(120, 256, size=(3, 1))
    return images.astype(np.uint8), labels.astype(np.int64)


def load_shapes(root: Path, download: bool) -> tuple[ImageDataset, ImageDataset]:
    """2000 training and 500 test images of four shapes; `root` and `download` are not needed."""
    train_images, train_labels = draw_shapes(2000, seed=0)
    test_images, test_labels = draw_shapes(500, seed=1)
    pixels = train_images / 255
    mean = tuple(float(m) for m in pixels.mean(axis=(0, 2, 3)))
    std = tuple(float(s) for s in pixels.std(axis=(0, 2, 3)))
    return (
        ImageDataset(torch.from_numpy(train_images), torch.from_numpy(train_labels), len(CLASSES), mean, std),
        ImageDataset(torch.from_numpy(test_images), torch.from_numpy(test_labels), len(CLASSES), mean, std),
    )
