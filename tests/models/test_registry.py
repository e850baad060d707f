"""Models built by name from the registry, each a feature classifier for CIFAR-like and digits inputs, and
bad settings refused naming the field."""

import pytest
from model_checks import CIFAR, DIGITS, check_feature_classifier

from fl_lightning.errors import ConfigError
from fl_lightning.models import create_model, model_label, registered_models


def test_registered_names():
    assert registered_models() == ["linear", "mlp", "lenet5", "resnet18", "vit_tiny"]


def test_a_registered_model_is_labelled_as_papers_name_it():
    assert [model_label(name) for name in ("lenet5", "resnet18", "vit_tiny", "mlp", "resnet50")] == [
        "LeNet-5", "ResNet-18", "ViT-Tiny", "MLP", "resnet50"]


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
