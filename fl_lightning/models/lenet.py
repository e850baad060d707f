"""LeNet-5 as used in federated-learning benchmarks (ReLU and max-pooling, no normalisation)."""

from __future__ import annotations

import torch
from torch import nn

from fl_lightning.errors import ConfigError
from fl_lightning.models.registry import FeatureClassifier, register_model

KERNEL_SIZE = 5


def _side_after_features(image_size: int, padding: int) -> int:
    """Spatial side after the two conv + max-pool stages."""
    side = image_size
    for _ in range(2):
        side = (side + 2 * padding - KERNEL_SIZE + 1) // 2
    return side


class LeNet5(FeatureClassifier):
    """conv(6, 5x5)-ReLU-pool, conv(16, 5x5)-ReLU-pool, fc 120, fc 84, classifier.

    The convolutions are unpadded whenever the image is large enough, which keeps the classic
    network exact on 32x32 (400 inputs to fc1); smaller images such as 8x8 digits would shrink
    to nothing, so there the convolutions are zero-padded to keep their input size.
    """

    def __init__(self, num_classes: int, in_channels: int, image_size: int, bias: bool = True):
        super().__init__()
        padding = 0 if _side_after_features(image_size, 0) >= 1 else KERNEL_SIZE // 2
        side = _side_after_features(image_size, padding)
        if side < 1:
            raise ConfigError(
                "model.name",
                "a model that fits the images (lenet5 needs at least 4x4)",
                f"lenet5 on {image_size}x{image_size}",
            )
        self.conv1 = nn.Conv2d(in_channels, 6, KERNEL_SIZE, padding=padding, bias=bias)
        self.conv2 = nn.Conv2d(6, 16, KERNEL_SIZE, padding=padding, bias=bias)
        self.fc1 = nn.Linear(16 * side * side, 120, bias=bias)
        self.fc2 = nn.Linear(120, 84, bias=bias)
        self.feature_dim = 84
        self.classifier = nn.Linear(84, num_classes, bias=bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.relu(self.fc1(torch.flatten(x, 1)))
        return torch.relu(self.fc2(x))


@register_model("lenet5", label="LeNet-5")
def lenet5(
    num_classes: int, in_channels: int, image_size: int, norm: str, bias: bool
) -> LeNet5:
    """LeNet-5; it has no normalisation layers and ignores `norm`."""
    return LeNet5(num_classes, in_channels, image_size, bias=bias)
