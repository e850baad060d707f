"""The model registry: a name maps to a constructor, `create_model` builds from the config.

`model.name` is one of three things, looked up in this order:

- a registered name (`registered_models()`: linear, mlp, lenet5, resnet18, vit_tiny);
- a factory of the user's by dotted path, `module.function` or `module.Class`, importable from
  `sys.path` (e.g. `model.name: my_model.make_net` with `PYTHONPATH=examples`);
- any timm model name.

A factory is called with keywords only, as

    factory(num_classes=..., in_channels=..., image_size=..., norm=..., bias=..., **model.options)

where `num_classes` (int), `in_channels` (int) and `image_size` (int, the side of the square
images) come from the data, and `norm` ("bn", "gn" or "none"), `bias` (bool) and `model.options`
(a dict) from the config. It must accept the five named arguments (ignoring those it has no use
for) and every key of `model.options`, and return an `nn.Module` that follows the interface of
`FeatureClassifier` (subclassing it is simplest):

- `forward_features(x)`: images [B, in_channels, image_size, image_size] (normalised floats) ->
  features [B, feature_dim];
- `classifier`: one `nn.Linear(feature_dim, num_classes)`, the last layer;
- `feature_dim`: an int;
- `forward(x) == classifier(forward_features(x))`: the logits the loss is taken on.

Every model follows this interface, so algorithms can reach the representation before the last
layer (MOON's projection head, feature-space regularisers, CONST's classifier) without knowing the
architecture.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, get_args

import torch
from torch import nn

from fl_lightning.choices import Norm
from fl_lightning.configurable import missing_module, resolve_dotted_path, why_unresolved
from fl_lightning.errors import ConfigError
from fl_lightning.registry import Registry

NORMS = get_args(Norm)
FACTORY_ARGUMENTS = ("num_classes", "in_channels", "image_size", "norm", "bias")
"""The keyword arguments every model factory given by dotted path receives (besides model.options)."""
FACTORY_RETURNS = (
    "a factory returning an nn.Module with forward_features(x), classifier (an nn.Linear) and feature_dim "
    "(an int), as FeatureClassifier has"
)

ModelConstructor = Callable[..., "FeatureClassifier"]
_model_constructors: Registry[ModelConstructor] = Registry("model")


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


def register_model(name: str, label: Optional[str] = None) -> Callable[[ModelConstructor], ModelConstructor]:
    """Register a constructor under `name`, labelled `label` in tables (default: the name).

    A constructor takes `(num_classes, in_channels, image_size, norm, bias)` plus its options as
    keyword-only parameters; `create_model` rejects any option not among them.
    """
    return _model_constructors.register(name, label)


def model_label(name: str) -> str:
    """How a table names the model `name` (LeNet-5 for lenet5); a name not registered as it is given."""
    return _model_constructors.label(name) or name


def registered_models() -> list[str]:
    """The registered names in registration order (timm models are reachable beyond these)."""
    return _model_constructors.names()


def create_model(
    name: str,
    num_classes: int,
    in_channels: int,
    image_size: int,
    norm: str = "bn",
    bias: bool = True,
    **options,
) -> FeatureClassifier:
    """Build a registered model, a user's factory by dotted path (`module.function`), or any timm
    architecture by name (never with pretrained weights).

    `norm` picks the normalisation layers of models that let it be chosen (resnet18); models
    without normalisation layers ignore it, timm models keep their own. `bias` switches the
    biases of every conv and linear layer. Settings a model cannot honour raise `ConfigError`
    naming the config field (`model.name`, `model.norm`, `model.bias`, `model.options`).
    """
    if norm not in NORMS:
        raise ConfigError("model.norm", "one of " + ", ".join(NORMS), norm)
    constructor = _model_constructors.get(name)
    if constructor is not None:
        _check_options(constructor, options)
        return constructor(num_classes, in_channels, image_size, norm, bias, **options)
    factory = _user_factory(name)
    if factory is not None:
        _check_factory_arguments(name, factory, options)
        network = factory(num_classes=num_classes, in_channels=in_channels, image_size=image_size, norm=norm,
                          bias=bias, **options)
        return _check_model(name, network)
    return create_timm_model(name, num_classes, in_channels, norm, bias, **options)


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


def model_help(name: str) -> str:
    """What `fl-lightning fit --model.help NAME` prints: the model's `model.options` with their
    defaults, and its description."""
    constructor = _model_constructors.get(name)
    if constructor is not None:
        parameters = [p for p in inspect.signature(constructor).parameters.values()
                      if p.kind is inspect.Parameter.KEYWORD_ONLY]
        source = f"registered model {name}"
    else:
        factory = _user_factory(name)
        if factory is None:
            return (f"timm model {name}: model.options are passed on to timm.create_model "
                    "(never with pretrained weights); model.norm and model.bias as for every model.")
        parameters = [p for p in inspect.signature(factory).parameters.values()
                      if p.name not in FACTORY_ARGUMENTS and p.kind is not inspect.Parameter.VAR_KEYWORD]
        constructor, source = factory, f"model factory {name}"
    options = [f"  {p.name}" + (" (required)" if p.default is inspect.Parameter.empty else f" (default {p.default!r})")
               for p in parameters]
    description = inspect.getdoc(constructor) or ""
    lines = [f"{source}; keys of model.options (e.g. --model.options '{{key: value}}'):", *(options or ["  (none)"])]
    return "\n".join([*lines, "", description]).rstrip()


def check_model_settings(name: str, options: dict) -> None:
    """Raise the `ConfigError` that `create_model` would raise for an unknown `name`, an unusable
    factory or options the model does not take, without building anything: `ModelArgs` calls it,
    so such mistakes fail while the settings are read. (timm models check their options when built.)"""
    constructor = _model_constructors.get(name)
    if constructor is not None:
        _check_options(constructor, options)
        return
    factory = _user_factory(name)
    if factory is not None:
        _check_factory_arguments(name, factory, options)


def _user_factory(name: str) -> Optional[Callable[..., nn.Module]]:
    """The callable `name` points to when it is an importable dotted path; None for a timm model
    name; a ConfigError naming model.name for anything else."""
    problem = None
    if "." in name:
        try:
            factory = resolve_dotted_path(name)
        except ValueError:
            pass  # no dotted path: perhaps a timm name (hf-hub:...)
        except Exception as err:  # AttributeError, or anything the user's module raises on import
            if not missing_module(name, err):
                raise ConfigError("model.name", "an importable model factory as module.function",
                                  why_unresolved(name, err)) from err
            # A timm name may hold a dot (resnet18.a1_in1k); else the top module is not on sys.path.
            problem = why_unresolved(name, err)
        else:
            if not callable(factory):
                raise ConfigError("model.name", "a callable model factory (a function or an nn.Module class) "
                                  "at that dotted path", f"{name}, of type {type(factory).__name__}")
            return factory
    import timm  # slow to import; only timm names get this far

    if not timm.is_model(name):
        expected = ("one of " + ", ".join(registered_models())
                    + ", a timm model name, or a model factory as module.function (importable)")
        raise ConfigError("model.name", expected, problem or name)
    return None


def _check_factory_arguments(name: str, factory: Callable, options: dict) -> None:
    """The factory must take FACTORY_ARGUMENTS and the options as keywords; checked before the call,
    so that a TypeError raised inside the factory is never mistaken for a wrong signature."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    parameters = signature.parameters.values()
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    keywords = [p.name for p in parameters
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if not any_keyword and not set(FACTORY_ARGUMENTS) <= set(keywords):
        raise ConfigError("model.name", "a factory taking the keyword arguments " + ", ".join(FACTORY_ARGUMENTS)
                          + " (and the keys of model.options)", f"{name}{signature}")
    unknown = sorted(set(options) - set(keywords))
    if unknown and not any_keyword:
        accepted = [key for key in keywords if key not in FACTORY_ARGUMENTS]
        expected = "keys among " + ", ".join(accepted) if accepted else f"no options for {name}"
        raise ConfigError("model.options", expected, {key: options[key] for key in unknown})
    try:
        signature.bind(**dict.fromkeys(FACTORY_ARGUMENTS), **options)
    except TypeError as err:  # a required option left out
        raise ConfigError("model.options", f"the options {name}{signature} requires ({err})", options) from err


def _check_model(name: str, model: object) -> nn.Module:
    """A factory's model must follow the FeatureClassifier interface, or algorithms fail later."""
    if not isinstance(model, nn.Module):
        raise ConfigError("model.name", FACTORY_RETURNS,
                          f"{name}, which returned a value of type {type(model).__name__}")
    problems = []
    if not callable(getattr(model, "forward_features", None)):
        problems.append("no forward_features")
    classifier = getattr(model, "classifier", None)
    if not isinstance(classifier, nn.Linear):
        problems.append(f"classifier of type {type(classifier).__name__}")
    feature_dim = getattr(model, "feature_dim", None)
    if isinstance(feature_dim, bool) or not isinstance(feature_dim, int):
        problems.append(f"feature_dim {feature_dim!r}")
    elif isinstance(classifier, nn.Linear) and classifier.in_features != feature_dim:
        problems.append(f"feature_dim {feature_dim} but classifier.in_features {classifier.in_features}")
    if problems:
        raise ConfigError("model.name", FACTORY_RETURNS,
                          f"{name}, whose {type(model).__name__} has " + ", ".join(problems))
    return model


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
