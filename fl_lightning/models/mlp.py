"""Fully connected models on flattened images: multinomial logistic regression and an MLP.

Neither has normalisation layers, so both ignore `norm`.
"""

from __future__ import annotations

import torch
from torch import nn

from fl_lightning.models.registry import FeatureClassifier, register_model, require_positive_int


class LinearClassifier(FeatureClassifier):
    """Multinomial logistic regression: the features are the flattened pixels.

    The loss is convex in the parameters, which is what convergence checks against theory need.
    """

    def __init__(self, num_classes: int, in_features: int, bias: bool = True):
        super().__init__()
        self.feature_dim = in_features
        self.classifier = nn.Linear(in_features, num_classes, bias=bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(x, 1)


class MLP(FeatureClassifier):
    """`depth` hidden layers of width `hidden` with ReLU, then the linear classifier."""

    def __init__(
        self, num_classes: int, in_features: int, hidden: int, depth: int, bias: bool = True
    ):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden, bias=bias), nn.ReLU(inplace=True)]
            width = hidden
        self.features = nn.Sequential(*layers)
        self.feature_dim = hidden
        self.classifier = nn.Linear(hidden, num_classes, bias=bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


@register_model("linear", label="linear model")
def linear(
    num_classes: int, in_channels: int, image_size: int, norm: str, bias: bool
) -> LinearClassifier:
    return LinearClassifier(num_classes, in_channels * image_size * image_size, bias=bias)


@register_model("mlp", label="MLP")
def mlp(
    num_classes: int,
    in_channels: int,
    image_size: int,
    norm: str,
    bias: bool,
    *,
    hidden: int = 200,
    depth: int = 2,
) -> MLP:
    return MLP(
        num_classes,
        in_channels * image_size * image_size,
        hidden=require_positive_int("model.options.hidden", hidden),
        depth=require_positive_int("model.options.depth", depth),
        bias=bias,
    )
