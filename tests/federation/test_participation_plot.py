"""The participation pattern's picture (fl_lightning/federation/participation_plot.py): each client's state
in each round as the rounds draw it, and the file a run with a participation model or dropouts writes."""

import numpy as np
from reference import small_setup

from fl_lightning.algorithms import FedAvg
from fl_lightning.config import FederationArgs
from fl_lightning.federation.aggregation import round_clients
from fl_lightning.federation.participation_plot import (
    DROPPED,
    OFFLINE,
    ONLINE,
    PARTICIPATION_PLOT,
    REPORTED,
    participation_states,
)
from fl_lightning.fit import fit
from fl_lightning.participation import Availability


def test_each_client_and_round_has_the_state_the_round_drew():
    federation = FederationArgs(num_clients=8, clients_per_round=3, local_steps=1, dropout=0.3,
                                participation=Availability(probability=0.6))
    states = participation_states(5, federation, rounds=40)
    for round_index in range(40):
        taking_part = round_clients(5, round_index, federation)
        expected = np.full(8, OFFLINE)
        expected[taking_part.online] = ONLINE
        expected[taking_part.reported] = REPORTED
        expected[taking_part.dropped] = DROPPED
        np.testing.assert_array_equal(states[:, round_index], expected)
    assert {OFFLINE, ONLINE, REPORTED, DROPPED} == set(np.unique(states))


def test_a_run_with_a_participation_model_or_dropouts_draws_its_pattern(cifar_root, tmp_path):
    fit(algorithm=FedAvg(), **small_setup(cifar_root, tmp_path / "uniform", rounds=1))
    assert not (tmp_path / "uniform" / PARTICIPATION_PLOT).exists()
    fit(algorithm=FedAvg(), **small_setup(cifar_root, tmp_path / "dropouts", rounds=1, dropout=0.2))
    assert (tmp_path / "dropouts" / PARTICIPATION_PLOT).read_bytes().startswith(b"\x89PNG")
