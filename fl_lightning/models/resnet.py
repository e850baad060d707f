"""ResNet-18 in its CIFAR form, with selectable normalisation and biases.

The CIFAR form replaces ImageNet's 7x7 stride-2 stem and max-pool with one 3x3 stride-1 conv, so
32x32 inputs still reach the last stage at 4x4. `norm="none"` with `bias=False` gives the
normalisation-free, bias-free network FedCONST trains.
"""

from __future__ import annotations

import torch
from torch import nn

from fl_lightning.models.registry import FeatureClassifier, register_model

STAGE_WIDTHS = (64, 128, 256, 512)
BLOCKS_PER_STAGE = (2, 2, 2, 2)


def norm_layer(norm: str, channels: int) -> nn.Module:
    if norm == "bn":
        return nn.BatchNorm2d(channels)
    if norm == "gn":
        return nn.GroupNorm(min(32, channels), channels)
    return nn.Identity()


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int, norm: str, bias: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=bias)
        self.norm1 = norm_layer(norm, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=bias)
        self.norm2 = norm_layer(norm, channels)
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=bias),
                norm_layer(norm, channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class CifarResNet18(FeatureClassifier):
    def __init__(self, num_classes: int, in_channels: int, norm: str = "bn", bias: bool = True):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, STAGE_WIDTHS[0], 3, stride=1, padding=1, bias=bias),
            norm_layer(norm, STAGE_WIDTHS[0]),
            nn.ReLU(inplace=True),
        )
        stages = []
        width = STAGE_WIDTHS[0]
        for index, (channels, blocks) in enumerate(zip(STAGE_WIDTHS, BLOCKS_PER_STAGE)):
            stride = 1 if index == 0 else 2
            stage = []
            for block in range(blocks):
                stage.append(BasicBlock(width, channels, stride if block == 0 else 1, norm, bias))
                width = channels
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = width
        self.classifier = nn.Linear(width, num_classes, bias=bias)
        self._init_conv_weights()

    def _init_conv_weights(self) -> None:
        # He initialisation keeps activations at unit scale through the ReLUs; without
        # normalisation layers nothing else would correct a badly scaled start.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.stages(self.stem(x))), 1)


@register_model("resnet18", label="ResNet-18")
def resnet18(
    num_classes: int, in_channels: int, image_size: int, norm: str, bias: bool
) -> CifarResNet18:
    """CIFAR ResNet-18; any image size works, the average pool absorbs the last stage's size."""
    return CifarResNet18(num_classes, in_channels, norm=norm, bias=bias)
