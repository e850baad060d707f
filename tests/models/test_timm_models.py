"""timm's models: ViT-Tiny with its patch size for small images, and any timm model by name."""

from model_checks import CIFAR, DIGITS, check_feature_classifier

from fl_lightning.models import create_model


def test_vit_tiny_patch_size():
    model = create_model("vit_tiny", **CIFAR)
    assert model.model.patch_embed.patch_size == (4, 4)
    assert model.feature_dim == 192
    model = create_model("vit_tiny", **DIGITS, patch_size=2)
    check_feature_classifier(model, DIGITS)


def test_timm_model_by_name():
    model = create_model("resnet10t", **CIFAR)
    check_feature_classifier(model, CIFAR)
