"""The checks every model must pass: logits, features and the classifier on them, for CIFAR-like and
digits-like inputs."""

import torch
from torch import nn

from fl_lightning.models import FeatureClassifier

# Inputs whose features every model must produce: CIFAR-like and 8x8 single-channel digits.
CIFAR = dict(num_classes=10, in_channels=3, image_size=32)
DIGITS = dict(num_classes=10, in_channels=1, image_size=8)


def images(num_channels: int, size: int, batch: int = 2) -> torch.Tensor:
    """A seeded batch of random images."""
    return torch.randn(batch, num_channels, size, size, generator=torch.Generator().manual_seed(0))


def check_feature_classifier(model: FeatureClassifier, shape: dict) -> None:
    """Logits are the classifier on the features, and the classifier's parameters come last."""
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
