"""ViT-Tiny, a timm architecture registered under its own name (any other timm model is reachable by
its timm name: `registry.create_timm_model`)."""

from __future__ import annotations

from typing import Optional

from fl_lightning.errors import ConfigError
from fl_lightning.models.registry import TimmClassifier, create_timm_model, register_model, require_positive_int


@register_model("vit_tiny", label="ViT-Tiny")
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
