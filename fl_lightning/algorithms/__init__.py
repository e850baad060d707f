"""Federated algorithms, selectable by class path, class name or short name.

Every module in this package is imported here, so each algorithm registers its short name just by
defining a subclass of `Algorithm` with `short_name` set.
"""

import importlib
import pkgutil

from fl_lightning.algorithms.base import SHORT_NAMES, Algorithm

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from fl_lightning.algorithms.ctpfl import CTPFL  # noqa: E402
from fl_lightning.algorithms.fedavg import FedAvg  # noqa: E402

__all__ = ["Algorithm", "CTPFL", "FedAvg", "SHORT_NAMES"]
