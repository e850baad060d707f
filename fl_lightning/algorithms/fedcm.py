"""FedCM (Xu et al. 2021): every local step follows alpha g(y) + (1 - alpha) Delta^r, where
Delta^r = sum_i p_i (x - y_i) / (lr K_i) is the previous round's aggregated local step per unit lr
(Delta^0 = 0); the server steps on sum_i p_i (x - y_i).

That is FedAvg-M's rule with alpha for beta (Cheng et al. analyse this same update), so FedCM
reuses it and differs only in its name and default weight.
"""

from __future__ import annotations

from fl_lightning.algorithms.fedavg_client_momentum import FedAvgClientMomentum, check_gradient_weight


class FedCM(FedAvgClientMomentum):
    short_name = "fedcm"

    def __init__(self, alpha: float = 0.1):
        """
        Args:
            alpha: weight of the local gradient in each local step, in (0, 1]; 1 is FedAvg.
        """
        check_gradient_weight("algorithm.init_args.alpha", alpha)
        self.alpha = alpha

    @property
    def gradient_weight(self) -> float:
        return self.alpha
