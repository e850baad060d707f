"""FedAvgM (Hsu et al. 2019), server-side momentum: FedAvg with m <- beta m + sum_i p_i (x - y_i),
x <- x - gamma m. Not FedAvg-M (`fedavg_client_momentum`), whose momentum is the clients'.

The momentum is the server optimizer's (ServerSGD); FedAvgM only fixes it, so the configured
`server_optimizer` must be a ServerSGD without momentum of its own and supplies gamma (its lr).
"""

from __future__ import annotations

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.errors import ConfigError
from fl_lightning.server_optimizers import ServerOptimizer, ServerSGD


class FedAvgServerMomentum(FedAvg):
    short_name = "fedavg_server_momentum"
    former_names = ("fedavgm", "FedAvgM")

    def __init__(self, server_momentum: float = 0.9):
        """
        Args:
            server_momentum: beta of the server's heavy-ball momentum, in [0, 1).
        """
        if not 0 <= server_momentum < 1:
            raise ConfigError("algorithm.init_args.server_momentum", "a value in [0, 1)", server_momentum)
        self.server_momentum = server_momentum

    def server_optimizer_for(self, server_optimizer: ServerOptimizer) -> ServerOptimizer:
        if not isinstance(server_optimizer, ServerSGD):
            raise ConfigError("server_optimizer", "ServerSGD with FedAvgM (its momentum is FedAvgM's)",
                              type(server_optimizer).__name__)
        if server_optimizer.momentum:
            raise ConfigError("server_optimizer.momentum",
                              "0 with FedAvgM, which sets it from algorithm.init_args.server_momentum",
                              server_optimizer.momentum)
        # A fresh optimizer: the configured one is hyper-parameters, as the config file records them.
        return ServerSGD(lr=server_optimizer.lr, momentum=self.server_momentum)
