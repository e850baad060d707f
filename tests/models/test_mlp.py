"""The linear model (logistic regression) and the MLP: their layers and options."""

from model_checks import DIGITS
from torch import nn

from fl_lightning.models import create_model


def test_linear_is_logistic_regression():
    model = create_model("linear", **DIGITS)
    assert model.feature_dim == 64
    assert [type(m) for m in model.modules()] == [type(model), nn.Linear]


def test_mlp_options():
    model = create_model("mlp", **DIGITS, hidden=32, depth=3)
    widths = [m.out_features for m in model.modules() if isinstance(m, nn.Linear)]
    assert widths == [32, 32, 32, 10]
    assert model.feature_dim == 32
