"""Federated algorithms, selectable by class path, class name or short name."""

from fl_lightning.algorithms.base import Algorithm
from fl_lightning.algorithms.ctpfl import CTPFL
from fl_lightning.algorithms.fedavg import FedAvg

SHORT_NAMES: dict[str, type[Algorithm]] = {
    "fedavg": FedAvg,
    "ctpfl": CTPFL,
}

__all__ = ["Algorithm", "CTPFL", "FedAvg", "SHORT_NAMES"]
