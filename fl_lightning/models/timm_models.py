"""timm architectures behind the `FeatureClassifier` interface, always randomly initialised."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fl_lightning.errors import ConfigError
from fl_lightning.models.registry import FeatureClassifier, register_model, require_positive_int

# Fixed by the data or by the no-download rule; options must not override them.
_RESERVED_OPTIONS = ("num_classes", "in_chans", "pretrained")


class TimmClassifier(FeatureClassifier):
    """A timm model whose pooled, pre-logits output is the feature vector.

    `classifier` is the timm head itself rather than a copy, so the state dict and the parameter
    order stay timm's.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.feature_dim = self.classifier.in_features

    @property
    def classifier(self) -> nn.Linear:
        return self.model.get_classifier()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_head(self.model.forward_features(x), pre_logits=True)


def create_timm_model(
    name: str, num_classes: int, in_channels: int, norm: str, bias: bool, **options
) -> TimmClassifier:
    """Build timm's `name` without pretrained weights; `options` go to its constructor.

    The data's image size is not passed on, since most timm CNNs take any size and reject an
    `img_size` argument; transformers get theirs through `options` (`img_size`).
    """
    import timm  # slow to import; only timm models need it

    # timm networks fix their own normalisation and biases; resnet18's choices cannot be imposed.
    if norm != "bn":
        raise ConfigError(
            "model.norm",
            f"bn (the default) for timm's {name}, which keeps its own normalisation layers; "
            "gn and none are for resnet18",
            norm,
        )
    if not bias:
        raise ConfigError(
            "model.bias",
            f"true for timm's {name}, which fixes its own biases; "
            "bias-free models are linear, mlp, lenet5 and resnet18",
            bias,
        )
    reserved = sorted(set(options) & set(_RESERVED_OPTIONS))
    if reserved:
        raise ConfigError(
            "model.options",
            "none of " + ", ".join(_RESERVED_OPTIONS) + " (the data sets the first two; "
            "pretrained weights are never loaded)",
            {key: options[key] for key in reserved},
        )
    try:
        model = timm.create_model(
            name, pretrained=False, num_classes=num_classes, in_chans=in_channels, **options
        )
    except TypeError as error:
        raise ConfigError(
            "model.options", f"keyword arguments that timm's {name} accepts ({error})", options
        ) from error
    if not isinstance(model.get_classifier(), nn.Linear):
        raise ConfigError(
            "model.name",
            "a timm model whose classifier is a single nn.Linear "
            "(algorithms act on the features before it)",
            name,
        )
    return TimmClassifier(model)


@register_model("vit_tiny")
def vit_tiny(
    num_classes: int,
    in_channels: int,
    image_size: int,
    norm: str,
    bias: bool,
    *,
    patch_size: Optional[int] = None,
) -> TimmClassifier:
    """ViT-Tiny (width 192, depth 12, 3 heads) at the data's image size.

    Small patches by default (4 up to 32x32, else 8) so that small images still give enough tokens.
    Other ViT settings are reachable by naming a timm model directly with `options`.
    """
    if patch_size is None:
        patch_size = 4 if image_size <= 32 else 8
    require_positive_int("model.options.patch_size", patch_size)
    if image_size % patch_size:
        raise ConfigError(
            "model.options.patch_size", f"a divisor of the image size {image_size}", patch_size
        )
    return create_timm_model(
        "vit_tiny_patch16_224",
        num_classes,
        in_channels,
        norm,
        bias,
        img_size=image_size,
        patch_size=patch_size,
    )
