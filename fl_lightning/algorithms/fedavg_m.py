"""Where FedAvg-M (client-side momentum) lived before it was named `FedAvgClientMomentum`: the configs,
checkpoints and run folders written before then name it `fl_lightning.algorithms.fedavg_m.FedAvgMomentum`."""

from fl_lightning.algorithms.fedavg_client_momentum import FedAvgClientMomentum as FedAvgMomentum

__all__ = ["FedAvgMomentum"]
