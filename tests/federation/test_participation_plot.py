"""The participation pattern's picture (fl_lightning/federation/participation_plot.py): each client's state
in each round as the rounds draw it, and the file a run with a participation model or dropouts writes."""

import tracemalloc

import numpy as np
import pytest
from reference import small_setup

from fl_lightning.algorithms import FedAvg
from fl_lightning.config import FederationArgs
from fl_lightning.data.partition import PLOTTED_CLIENTS
from fl_lightning.federation.aggregation import round_clients
from fl_lightning.federation.participation_plot import (
    DROPPED,
    OFFLINE,
    ONLINE,
    PARTICIPATION_PLOT,
    REPORTED,
    participation_figure,
    participation_states,
)
from fl_lightning.fit import fit
from fl_lightning.participation import Availability


def drawn_states(seed, federation, rounds):
    """(clients, rounds) states of every client, straight from each round's draws."""
    states = np.full((federation.num_clients, rounds), OFFLINE)
    for round_index in range(rounds):
        taking_part = round_clients(seed, round_index, federation)
        states[list(taking_part.online), round_index] = ONLINE
        states[taking_part.reported, round_index] = REPORTED
        states[taking_part.dropped, round_index] = DROPPED
    return states


def test_each_client_and_round_has_the_state_the_round_drew():
    federation = FederationArgs(num_clients=8, clients_per_round=3, local_steps=1, dropout=0.3,
                                participation=Availability(probability=0.6))
    states = participation_states(5, federation, rounds=40)
    np.testing.assert_array_equal(states, drawn_states(5, federation, 40))
    assert {OFFLINE, ONLINE, REPORTED, DROPPED} == set(np.unique(states))


@pytest.mark.parametrize("participation", [None, Availability(probability=0.6)], ids=["uniform", "availability"])
def test_past_a_thousand_clients_the_first_thousand_have_the_states_the_rounds_drew(participation):
    federation = FederationArgs(num_clients=2500, clients_per_round=1200, local_steps=1, dropout=0.3,
                                participation=participation)
    states = participation_states(5, federation, rounds=6)
    np.testing.assert_array_equal(states, drawn_states(5, federation, 6)[:PLOTTED_CLIENTS])
    assert {ONLINE, REPORTED, DROPPED} <= set(np.unique(states))


def peak_of_participation_states(num_clients: int) -> int:
    federation = FederationArgs(num_clients=num_clients, clients_per_round=10, local_steps=1, dropout=0.3)
    tracemalloc.start()
    try:
        participation_states(1, federation, rounds=100)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_states_of_100000_clients_take_the_memory_of_a_thousand():
    # Compared with a thousand clients' peak, not a fixed one: the rounds' draws leave a few MB of garbage
    # for the collector, as many for any number of clients. Every client's states would be 10 MB more.
    assert peak_of_participation_states(100_000) - peak_of_participation_states(PLOTTED_CLIENTS) < 2**20


def test_the_picture_of_100000_clients_shows_the_first_thousand_and_says_so():
    federation = FederationArgs(num_clients=100_000, clients_per_round=10, local_steps=1, dropout=0.3, rounds=3)
    (axes, *_), states = participation_figure(0, federation).axes, participation_states(0, federation, 3)
    assert axes.get_title().splitlines() == ["participation: uniform, 10 drawn a round, dropout 0.3",
                                             "clients 0-999 of 100,000"]
    np.testing.assert_array_equal(axes.get_images()[0].get_array(), states)
    small = FederationArgs(num_clients=PLOTTED_CLIENTS, clients_per_round=10, local_steps=1, dropout=0.3, rounds=3)
    (axes, *_) = participation_figure(0, small).axes
    assert axes.get_title() == "participation: uniform, 10 drawn a round, dropout 0.3"


def test_a_run_with_a_participation_model_or_dropouts_draws_its_pattern(cifar_root, tmp_path):
    fit(algorithm=FedAvg(), **small_setup(cifar_root, tmp_path / "uniform", rounds=1))
    assert not (tmp_path / "uniform" / PARTICIPATION_PLOT).exists()
    fit(algorithm=FedAvg(), **small_setup(cifar_root, tmp_path / "dropouts", rounds=1, dropout=0.2))
    assert (tmp_path / "dropouts" / PARTICIPATION_PLOT).read_bytes().startswith(b"\x89PNG")
