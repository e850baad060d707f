"""Models behind one interface: `create_model(name, ...)` returns a `FeatureClassifier`."""

# Importing the model modules registers their constructors, in the order registered_models lists.
from fl_lightning.models import mlp, lenet, resnet, timm_models  # noqa: F401  isort:skip
from fl_lightning.models.registry import (
    FeatureClassifier,
    create_model,
    model_label,
    register_model,
    registered_models,
)

__all__ = ["FeatureClassifier", "create_model", "model_label", "register_model", "registered_models"]
