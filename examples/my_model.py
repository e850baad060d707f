"""A model of your own: `--model.name my_model.make_net` (with this folder on PYTHONPATH).

fl-lightning calls the factory with keywords only, as
`make_net(num_classes=..., in_channels=..., image_size=..., norm=..., bias=..., **model.options)`,
and trains what it returns: an nn.Module with `forward_features`, `classifier` (one nn.Linear) and
`feature_dim`, which subclassing `FeatureClassifier` gives with `forward` for free.
"""

import torch
from torch import nn

from fl_lightning.models import FeatureClassifier


def norm_layer(norm: str, channels: int) -> nn.Module:
    if norm == "bn":
        return nn.BatchNorm2d(channels)
    if norm == "gn":
        return nn.GroupNorm(1, channels)
    return nn.Identity()


class SmallCNN(FeatureClassifier):
    """Two conv-norm-ReLU blocks with 2x2 max-pooling, a global average pool, then the classifier."""

    def __init__(self, num_classes: int, in_channels: int, norm: str, bias: bool, width: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=bias), norm_layer(norm, width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=bias), norm_layer(norm, 2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.feature_dim = 2 * width
        self.classifier = nn.Linear(self.feature_dim, num_classes, bias=bias)  # the last layer

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def make_net(num_classes: int, in_channels: int, image_size: int, norm: str, bias: bool,
             width: int = 16) -> SmallCNN:
    """`width` is a model option: `--model.options '{width: 32}'`. Any image size works (the
    average pool absorbs it), so `image_size` is not needed here."""
    return SmallCNN(num_classes, in_channels, norm, bias, width)
