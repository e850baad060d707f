import pytest
import torch
from torch import nn

from fl_lightning.errors import ConfigError
from fl_lightning.models import FeatureClassifier, create_model, registered_models

# Inputs whose features every model must produce: CIFAR-like and 8x8 single-channel digits.
CIFAR = dict(num_classes=10, in_channels=3, image_size=32)
DIGITS = dict(num_classes=10, in_channels=1, image_size=8)

# Well-known size of CIFAR ResNet-18 (bias-free convs, BatchNorm), less the 10 classifier biases.
CIFAR_RESNET18_PARAMETERS = 11_173_962 - 10


def images(num_channels: int, size: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, num_channels, size, size, generator=torch.Generator().manual_seed(0))


def check_feature_classifier(model: FeatureClassifier, shape: dict) -> None:
    model.eval()
    x = images(shape["in_channels"], shape["image_size"])
    with torch.no_grad():
        logits = model(x)
        features = model.forward_features(x)
        assert logits.shape == (2, shape["num_classes"])
        assert features.shape == (2, model.feature_dim)
        assert isinstance(model.classifier, nn.Linear)
        torch.testing.assert_close(logits, model.classifier(features))
    classifier_parameters = list(model.classifier.parameters())
    last_parameters = list(model.parameters())[-len(classifier_parameters):]
    assert all(a is b for a, b in zip(last_parameters, classifier_parameters))


def test_registered_names():
    assert registered_models() == ["linear", "mlp", "lenet5", "resnet18", "vit_tiny"]


@pytest.mark.parametrize("name", ["linear", "mlp", "lenet5", "resnet18", "vit_tiny"])
def test_builds_for_cifar(name):
    check_feature_classifier(create_model(name, **CIFAR), CIFAR)


@pytest.mark.parametrize("name", ["linear", "mlp", "lenet5", "resnet18"])
def test_builds_for_digits(name):
    check_feature_classifier(create_model(name, **DIGITS), DIGITS)


def test_first_parameter_is_first_layer_weight():
    lenet = create_model("lenet5", **CIFAR)
    assert next(lenet.parameters()) is lenet.conv1.weight
    resnet = create_model("resnet18", **CIFAR)
    assert next(resnet.parameters()) is resnet.stem[0].weight


def test_linear_is_logistic_regression():
    model = create_model("linear", **DIGITS)
    assert model.feature_dim == 64
    assert [type(m) for m in model.modules()] == [type(model), nn.Linear]


def test_mlp_options():
    model = create_model("mlp", **DIGITS, hidden=32, depth=3)
    widths = [m.out_features for m in model.modules() if isinstance(m, nn.Linear)]
    assert widths == [32, 32, 32, 10]
    assert model.feature_dim == 32


def test_lenet5_is_classic_on_32x32():
    model = create_model("lenet5", **CIFAR)
    assert model.fc1.in_features == 16 * 5 * 5
    assert model.conv1.padding == (0, 0)
    assert sum(p.numel() for p in model.parameters()) == 62_006


def test_lenet5_pads_small_images():
    model = create_model("lenet5", **DIGITS)
    assert model.fc1.in_features == 16 * 2 * 2


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


def test_vit_tiny_patch_size():
    model = create_model("vit_tiny", **CIFAR)
    assert model.model.patch_embed.patch_size == (4, 4)
    assert model.feature_dim == 192
    model = create_model("vit_tiny", **DIGITS, patch_size=2)
    check_feature_classifier(model, DIGITS)


def test_timm_model_by_name():
    model = create_model("resnet10t", **CIFAR)
    check_feature_classifier(model, CIFAR)


def error_field(**kwargs) -> str:
    with pytest.raises(ConfigError) as error:
        create_model(**kwargs)
    return error.value.field_name


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        (dict(name="no_such_model", **CIFAR), "model.name"),
        (dict(name="resnet18", **CIFAR, norm="ln"), "model.norm"),
        (dict(name="resnet18", **CIFAR, width=2), "model.options"),
        (dict(name="linear", **CIFAR, hidden=10), "model.options"),
        (dict(name="mlp", **CIFAR, hidden=0), "model.options.hidden"),
        (dict(name="mlp", **CIFAR, depth=1.5), "model.options.depth"),
        (dict(name="lenet5", num_classes=10, in_channels=1, image_size=3), "model.name"),
        (dict(name="vit_tiny", **CIFAR, patch_size=5), "model.options.patch_size"),
        (dict(name="vit_tiny", **CIFAR, norm="none"), "model.norm"),
        (dict(name="vit_tiny", **CIFAR, bias=False), "model.bias"),
        (dict(name="resnet10t", **CIFAR, pretrained=True), "model.options"),
        (dict(name="resnet10t", **CIFAR, no_such_option=1), "model.options"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field_name):
    assert error_field(**kwargs) == field_name
