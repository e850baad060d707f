"""ResNet-18 in the CIFAR form: its parameter count, its biases and its normalisation choices."""

import pytest
import torch
from model_checks import CIFAR, images
from torch import nn

from fl_lightning.models import create_model

# Well-known size of CIFAR ResNet-18 (bias-free convs, BatchNorm), less the 10 classifier biases.
CIFAR_RESNET18_PARAMETERS = 11_173_962 - 10


def test_resnet18_parameter_count():
    model = create_model("resnet18", **CIFAR, norm="bn", bias=False)
    assert sum(p.numel() for p in model.parameters()) == CIFAR_RESNET18_PARAMETERS


def test_resnet18_bias_covers_every_conv_and_linear():
    model = create_model("resnet18", **CIFAR, norm="bn", bias=True)
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert all(layer.bias is not None for layer in layers)
    extra = sum(layer.bias.numel() for layer in layers)
    assert sum(p.numel() for p in model.parameters()) == CIFAR_RESNET18_PARAMETERS + extra


def test_resnet18_without_norm_or_bias():
    model = create_model("resnet18", **CIFAR, norm="none", bias=False)
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) for m in model.modules())
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    with torch.no_grad():
        logits = model(images(3, 32))
    assert torch.isfinite(logits).all() and logits.abs().max() < 100


@pytest.mark.parametrize("norm, layer", [("bn", nn.BatchNorm2d), ("gn", nn.GroupNorm)])
def test_resnet18_norm(norm, layer):
    model = create_model("resnet18", **CIFAR, norm=norm)
    norms = [m for m in model.modules() if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm))]
    assert norms and all(isinstance(m, layer) for m in norms)
