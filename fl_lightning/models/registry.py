"""The model registry: a name maps to a constructor, `create_model` builds from the config.

Every model is a `FeatureClassifier`, so algorithms can reach the representation before the last
layer (MOON's projection head, feature-space regularisers) without knowing the architecture.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

from fl_lightning.config import ConfigError

NORMS = ("bn", "gn", "none")

ModelConstructor = Callable[..., "FeatureClassifier"]
_model_constructors: dict[str, ModelConstructor] = {}


class FeatureClassifier(nn.Module):
    """A network split into a feature extractor and one final linear layer.

    Subclasses set `feature_dim` and `classifier` and implement `forward_features`;
    `forward(x) == classifier(forward_features(x))` by construction.
    """

    feature_dim: int
    classifier: nn.Linear

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The representation fed to `classifier`, shape [B, feature_dim]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.forward_features(x))


def register_model(name: str) -> Callable[[ModelConstructor], ModelConstructor]:
    """Register a constructor under `name`.

    A constructor takes `(num_classes, in_channels, image_size, norm, bias)` plus its options as
    keyword-only parameters; `create_model` rejects any option not among them.
    """

    def register(constructor: ModelConstructor) -> ModelConstructor:
        if name in _model_constructors:
            raise ValueError(f"model {name!r} is registered twice")
        _model_constructors[name] = constructor
        return constructor

    return register


def registered_models() -> list[str]:
    """The registered names in registration order (timm models are reachable beyond these)."""
    return list(_model_constructors)


def create_model(
    name: str,
    num_classes: int,
    in_channels: int,
    image_size: int,
    norm: str = "bn",
    bias: bool = True,
    **options,
) -> FeatureClassifier:
    """Build a registered model, or any timm architecture by name (never with pretrained weights).

    `norm` picks the normalisation layers of models that let it be chosen (resnet18); models
    without normalisation layers ignore it, timm models keep their own. `bias` switches the
    biases of every conv and linear layer. Settings a model cannot honour raise `ConfigError`
    naming the config field (`model.name`, `model.norm`, `model.bias`, `model.options`).
    """
    if norm not in NORMS:
        raise ConfigError("model.norm", "one of " + ", ".join(NORMS), norm)
    constructor = _model_constructors.get(name)
    if constructor is None:
        # Deferred because timm_models registers vit_tiny through this module.
        import timm

        from fl_lightning.models.timm_models import create_timm_model

        if not timm.is_model(name):
            raise ConfigError(
                "model.name",
                "one of " + ", ".join(registered_models()) + " or a timm model name",
                name,
            )
        return create_timm_model(name, num_classes, in_channels, norm, bias, **options)
    _check_options(constructor, options)
    return constructor(num_classes, in_channels, image_size, norm, bias, **options)


def _check_options(constructor: ModelConstructor, options: dict) -> None:
    parameters = inspect.signature(constructor).parameters.values()
    accepted = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        expected = "keys among " + ", ".join(accepted) if accepted else "no options for this model"
        raise ConfigError("model.options", expected, {key: options[key] for key in unknown})


def require_positive_int(field_name: str, value: object) -> int:
    """Reject option values such as 0, 2.5 or True before they reach a layer constructor."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field_name, "a positive integer", value)
    return value
