"""Where FedAvgM (server-side momentum) lived before it was named `FedAvgServerMomentum`: the configs,
checkpoints and run folders written before then name it `fl_lightning.algorithms.fedavgm.FedAvgM`."""

from fl_lightning.algorithms.fedavg_server_momentum import FedAvgServerMomentum as FedAvgM

__all__ = ["FedAvgM"]
