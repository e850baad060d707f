"""LeNet-5: the classic layers on 32x32 images, and small images padded up to them."""

from model_checks import CIFAR, DIGITS

from fl_lightning.models import create_model


def test_lenet5_is_classic_on_32x32():
    model = create_model("lenet5", **CIFAR)
    assert model.fc1.in_features == 16 * 5 * 5
    assert model.conv1.padding == (0, 0)
    assert sum(p.numel() for p in model.parameters()) == 62_006


def test_lenet5_pads_small_images():
    model = create_model("lenet5", **DIGITS)
    assert model.fc1.in_features == 16 * 2 * 2
