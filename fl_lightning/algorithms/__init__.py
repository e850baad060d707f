"""Federated algorithms, selectable by class path, class name or short name.

Each algorithm is importable from here (`fl_lightning.algorithms.FedProx`); importing its module
registers its short name (`fedprox`), so a new module of this package is listed below. A renamed
class is importable by its former name too (`FedAvgM`, `FedAvgMomentum`), from its former module.
"""

from fl_lightning.algorithms.base import FORMER_NAMES, SHORT_NAMES, Algorithm
from fl_lightning.algorithms.ctpfl import CTPFL
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.fedavg_client_momentum import FedAvgClientMomentum
from fl_lightning.algorithms.fedavg_m import FedAvgMomentum
from fl_lightning.algorithms.fedavg_server_momentum import FedAvgServerMomentum
from fl_lightning.algorithms.fedavgm import FedAvgM
from fl_lightning.algorithms.fedcm import FedCM
from fl_lightning.algorithms.feddyn import FedDyn
from fl_lightning.algorithms.fednova import FedNova
from fl_lightning.algorithms.fedprox import FedProx
from fl_lightning.algorithms.fedsam import FedSAM
from fl_lightning.algorithms.moon import MOON
from fl_lightning.algorithms.scaffold import SCAFFOLD

__all__ = ["Algorithm", "SHORT_NAMES", "FORMER_NAMES", "CTPFL", "FedAvg", "FedAvgClientMomentum",
           "FedAvgServerMomentum", "FedCM", "FedDyn", "FedNova", "FedProx", "FedSAM", "MOON", "SCAFFOLD",
           "FedAvgMomentum", "FedAvgM"]
