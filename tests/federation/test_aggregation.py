"""A round's clients and their aggregation (fl_lightning.federation.aggregation): the draw of the
round's clients, their weights, which rank computes each, the stop votes, and the one flat buffer
that the all-reduce sums, checked against sums done by hand in float64."""

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fl_lightning.algorithms import SCAFFOLD, FedAvg
from fl_lightning.clients.run import SAMPLING_STREAM, seeded_generator
from fl_lightning.config import FederationArgs
from fl_lightning.federation.aggregation import (
    CLIENT_SECONDS,
    REQUEUE_REQUESTED,
    STOP_REQUESTED,
    UploadBuffer,
    aggregation_weights,
    clients_of_rank,
    is_final_vote,
    round_clients,
    sample_clients,
    stop_vote,
)
from fl_lightning.participation import Availability, Cyclic

CPU = torch.device("cpu")


class OneRank:
    """A stand-in for Fabric with one rank: `UploadBuffer.reduced` reads only `world_size`, and must make
    no collective at all."""

    world_size = 1

    def all_reduce(self, tensor, reduce_op):
        raise AssertionError("one rank has nothing to reduce")


class TwoRanks:
    """A stand-in for Fabric with two ranks whose buffers are equal: the sum over the ranks is twice
    the buffer. It keeps what it was asked to reduce."""

    world_size = 2

    def __init__(self):
        self.calls = []

    def all_reduce(self, tensor, reduce_op):
        self.calls.append((tensor, reduce_op))
        return tensor * 2


# The draw of a round's clients


def test_the_draw_is_sorted_distinct_and_of_the_size_asked():
    for seed, round_index in itertools.product((0, 1, 7), (0, 1, 50)):
        clients = sample_clients(seed, round_index, 30, 8)
        assert clients == sorted(set(clients)) and len(clients) == 8
        assert all(0 <= client < 30 for client in clients)


def test_full_participation_draws_every_client():
    assert sample_clients(4, 9, 12, 12) == list(range(12))


def test_the_draw_ignores_torchs_global_random_state():
    # Ranks may have drawn different amounts from torch's global generator: the round's clients must
    # not depend on it.
    torch.manual_seed(0)
    first = sample_clients(3, 2, 100, 10)
    torch.manual_seed(12345)
    torch.rand(1000)
    assert sample_clients(3, 2, 100, 10) == first


def test_the_seed_and_the_round_each_change_the_draw():
    draws = {(seed, round_index): tuple(sample_clients(seed, round_index, 100, 10))
             for seed in range(3) for round_index in range(20)}
    # 60 draws of 10 among 100: two equal draws would be a stream shared between seeds or rounds.
    assert len(set(draws.values())) == len(draws)


def test_over_many_rounds_every_client_is_drawn_about_equally_often():
    counts = [0] * 50
    rounds = 1000
    for round_index in range(rounds):
        for client in sample_clients(0, round_index, 50, 5):
            counts[client] += 1
    # Each client is drawn with probability 5/50 a round: 100 times expected, a binomial sd of 9.5.
    assert sum(counts) == rounds * 5
    assert min(counts) > 100 - 5 * 9.5 and max(counts) < 100 + 5 * 9.5


def test_uniform_participation_without_dropouts_draws_as_the_rounds_always_did():
    federation = FederationArgs(num_clients=30, clients_per_round=8, local_steps=1)
    for seed, round_index in itertools.product((0, 3), range(10)):
        generator = seeded_generator(seed, SAMPLING_STREAM, round_index)
        before = sorted(torch.randperm(30, generator=generator)[:8].tolist())
        taking_part = round_clients(seed, round_index, federation)
        assert list(taking_part.online) == list(range(30))
        assert taking_part.drawn == taking_part.reported == before and taking_part.dropped == []


def test_the_round_draws_its_clients_from_those_online_and_all_of_them_when_fewer():
    federation = FederationArgs(num_clients=20, clients_per_round=4, local_steps=1,
                                participation=Availability(probability=0.25))
    sizes = set()
    for round_index in range(200):
        taking_part = round_clients(0, round_index, federation)
        assert set(taking_part.drawn) <= set(taking_part.online)
        assert len(taking_part.drawn) == min(4, len(taking_part.online))
        sizes.add(len(taking_part.online))
    assert min(sizes) < 4 < max(sizes)  # both cases were met


def test_dropouts_lose_uploads_at_their_rate_and_the_counts_add_up():
    dropout, rounds = 0.2, 500
    federation = FederationArgs(num_clients=10, clients_per_round=6, local_steps=1, dropout=dropout,
                                participation=Cyclic(groups=1))
    dropped = 0
    for round_index in range(rounds):
        counts = round_clients(1, round_index, federation).counts()
        assert counts["clients_online"] == 10 and counts["clients_drawn"] == 6
        assert counts["clients_reported"] + counts["clients_dropped"] == 6
        dropped += counts["clients_dropped"]
    trials = rounds * 6
    assert abs(dropped - trials * dropout) <= 4.5 * math.sqrt(trials * dropout * (1 - dropout))


def test_a_dropout_is_the_clients_own_draw_whatever_else_the_round_draws():
    # Who is lost depends on (seed, round, client) alone: not on how many were drawn or who else was.
    few = FederationArgs(num_clients=12, clients_per_round=3, local_steps=1, dropout=0.5)
    every = FederationArgs(num_clients=12, clients_per_round=12, local_steps=1, dropout=0.5)
    for round_index in range(20):
        some, all_of_them = round_clients(2, round_index, few), round_clients(2, round_index, every)
        assert set(some.dropped) == set(all_of_them.dropped) & set(some.drawn)


# Weights


def test_sample_weights_are_each_clients_share_of_the_rounds_samples():
    sizes = [5, 40, 7, 13, 100]
    clients = [1, 2, 3]
    weights = aggregation_weights(clients, sizes, "num_samples")
    total = 40 + 7 + 13  # client 4's 100 samples are not in this round
    assert list(weights) == clients
    assert weights == pytest.approx({1: 40 / total, 2: 7 / total, 3: 13 / total})
    assert sum(weights.values()) == pytest.approx(1.0)


def test_uniform_weights_ignore_the_sizes():
    weights = aggregation_weights([0, 3, 4], [1, 1000, 1, 2, 99], "uniform")
    assert weights == pytest.approx({0: 1 / 3, 3: 1 / 3, 4: 1 / 3})


@pytest.mark.parametrize("weighting", ["num_samples", "uniform"])
def test_the_weights_are_the_floats_of_a_dict_of_them_and_only_the_rounds_clients_have_one(weighting):
    sizes = np.arange(1, 1001) * 7 % 113 + 1
    clients = [3, 17, 18, 250, 999]
    weights = aggregation_weights(clients, sizes, weighting)
    total = sum(int(sizes[c]) for c in clients)
    by_hand = {c: (int(sizes[c]) / total if weighting == "num_samples" else 1.0 / len(clients)) for c in clients}
    assert [weights[c] for c in clients] == [by_hand[c] for c in clients]  # bit for bit
    assert dict(weights) == by_hand and len(weights) == len(clients)
    for outside in (0, 4, 249, 251, 1000, -1):
        assert outside not in weights
        with pytest.raises(KeyError):
            weights[outside]


def test_one_client_takes_the_whole_weight_either_way():
    assert aggregation_weights([2], [10, 20, 30], "num_samples") == {2: 1.0}
    assert aggregation_weights([2], [10, 20, 30], "uniform") == {2: 1.0}


# Ranks


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_stateful_client_is_always_computed_by_the_rank_that_owns_its_state(world_size):
    for round_index in range(10):
        clients = sample_clients(0, round_index, 20, 7)
        for rank in range(world_size):
            assert all(client % world_size == rank for client in clients_of_rank(clients, rank, world_size, True))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 9])
def test_stateless_clients_are_dealt_out_in_shares_that_differ_by_at_most_one(world_size):
    clients = [0, 2, 6, 8, 10, 12, 14]  # all even: ownership by client id would leave odd ranks idle
    shares = [clients_of_rank(clients, rank, world_size, False) for rank in range(world_size)]
    assert sorted(client for share in shares for client in share) == clients
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1


def test_stateful_ownership_may_leave_a_rank_without_clients():
    # Client state lives on its owner: the even clients of two ranks are all rank 0's.
    clients = [0, 2, 4]
    assert clients_of_rank(clients, 0, 2, True) == clients
    assert clients_of_rank(clients, 1, 2, True) == []
    assert clients_of_rank(clients, 1, 2, False) == [2]


# Stop votes


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_summed_votes_say_whether_any_rank_asked_to_stop_and_whether_any_for_good(world_size):
    # Each rank asks nothing, interrupts, or asks a final stop (besides an interruption of its own).
    asks = ([], [False], [True], [False, True], [False, False])
    for per_rank in itertools.product(asks, repeat=world_size):
        total = sum(stop_vote(asked, world_size) for asked in per_rank)
        any_stop = any(per_rank)
        any_final = any(True in asked for asked in per_rank)
        assert (total > 0) == any_stop
        assert is_final_vote(total, world_size) == any_final


# The upload buffer


def test_the_buffer_holds_each_section_in_order_at_its_size():
    buffer = UploadBuffer(SCAFFOLD(), num_params=6, num_buffers=2, device=CPU)
    assert buffer.sections == [("pseudo_gradient", 6, True), ("buffers", 2, True), ("control_delta", 6, False),
                               ("train_loss", 1, True), (STOP_REQUESTED, 1, False), (REQUEUE_REQUESTED, 1, False),
                               (CLIENT_SECONDS, 1, False)]
    assert buffer.flat.shape == (6 + 2 + 6 + 1 + 1 + 1 + 1,)
    assert buffer.flat.eq(0).all()


def test_weighted_uploads_are_scaled_by_the_weight_and_summed_uploads_are_not():
    buffer = UploadBuffer(SCAFFOLD(), num_params=3, num_buffers=2, device=CPU)
    buffer.add({"pseudo_gradient": torch.tensor([1.0, 2.0, 3.0]), "buffers": torch.tensor([4.0, 8.0]),
                "control_delta": torch.tensor([1.0, -1.0, 2.0]), "train_loss": torch.tensor([2.0])}, 0.25)
    buffer.add({STOP_REQUESTED: torch.tensor([3.0]), REQUEUE_REQUESTED: torch.tensor([1.0])}, 0.25)
    torch.testing.assert_close(buffer.flat,
                               torch.tensor([0.25, 0.5, 0.75, 1.0, 2.0, 1.0, -1.0, 2.0, 0.5, 3.0, 1.0, 0.0]))


def test_a_section_left_out_of_an_add_keeps_its_value():
    buffer = UploadBuffer(FedAvg(), num_params=2, num_buffers=0, device=CPU)
    buffer.add({"pseudo_gradient": torch.tensor([1.0, 1.0])}, 0.5)
    buffer.add({"train_loss": torch.tensor([4.0])}, 0.5)
    reduced = buffer.reduced(OneRank())
    torch.testing.assert_close(reduced["pseudo_gradient"], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(reduced["train_loss"], torch.tensor([2.0]))
    assert reduced["buffers"].numel() == 0


@pytest.mark.parametrize("weighting", ["num_samples", "uniform"])
def test_the_reduced_buffer_is_the_weighted_sum_of_the_clients_uploads(weighting):
    generator = torch.Generator().manual_seed(0)
    num_params, num_buffers = 5, 3
    sizes = [17, 3, 60, 29, 1]
    clients = [0, 2, 3, 4]
    uploads = {client: {"pseudo_gradient": torch.randn(num_params, generator=generator),
                        "buffers": torch.randn(num_buffers, generator=generator),
                        "control_delta": torch.randn(num_params, generator=generator),
                        "train_loss": torch.rand(1, generator=generator)} for client in clients}
    weights = aggregation_weights(clients, sizes, weighting)
    buffer = UploadBuffer(SCAFFOLD(), num_params, num_buffers, CPU)
    for client in clients:
        buffer.add(uploads[client], weights[client])
    reduced = buffer.reduced(OneRank())

    # By hand, in float64: p_i from the sizes (or 1/n), the weighted sections sum p_i x_i, the summed
    # section sums x_i.
    total = sum(sizes[client] for client in clients)
    share = {client: (sizes[client] / total if weighting == "num_samples" else 1 / len(clients)) for client in clients}
    for name in ("pseudo_gradient", "buffers", "train_loss", "control_delta"):
        expected = [0.0] * uploads[clients[0]][name].numel()
        for client in clients:
            factor = 1.0 if name == "control_delta" else share[client]
            for index, value in enumerate(uploads[client][name].double().tolist()):
                expected[index] += factor * value
        torch.testing.assert_close(reduced[name].double(), torch.tensor(expected, dtype=torch.float64),
                                   rtol=1e-6, atol=1e-6)
    assert reduced[STOP_REQUESTED].item() == 0 and reduced[REQUEUE_REQUESTED].item() == 0


def test_sample_weighting_and_uniform_weighting_give_different_aggregates_for_unequal_clients():
    sizes = [10, 90]
    uploads = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]
    aggregates = {}
    for weighting in ("num_samples", "uniform"):
        buffer = UploadBuffer(FedAvg(), num_params=2, num_buffers=0, device=CPU)
        weights = aggregation_weights([0, 1], sizes, weighting)
        for client, upload in enumerate(uploads):
            buffer.add({"pseudo_gradient": upload}, weights[client])
        aggregates[weighting] = buffer.reduced(OneRank())["pseudo_gradient"]
    torch.testing.assert_close(aggregates["num_samples"], torch.tensor([0.1, 0.9]))
    torch.testing.assert_close(aggregates["uniform"], torch.tensor([0.5, 0.5]))


def test_several_ranks_sum_the_whole_buffer_in_one_all_reduce():
    buffer = UploadBuffer(SCAFFOLD(), num_params=2, num_buffers=1, device=CPU)
    buffer.add({"pseudo_gradient": torch.tensor([1.0, 2.0]), "buffers": torch.tensor([3.0]),
                "control_delta": torch.tensor([4.0, 5.0]), "train_loss": torch.tensor([6.0])}, 1.0)
    buffer.add({STOP_REQUESTED: torch.tensor([1.0])}, 1.0)
    fabric = TwoRanks()
    reduced = buffer.reduced(fabric)
    assert len(fabric.calls) == 1
    (tensor, reduce_op), = fabric.calls
    assert tensor is buffer.flat and reduce_op == "sum"
    torch.testing.assert_close(reduced["pseudo_gradient"], torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(reduced["buffers"], torch.tensor([6.0]))
    torch.testing.assert_close(reduced["control_delta"], torch.tensor([8.0, 10.0]))
    torch.testing.assert_close(reduced["train_loss"], torch.tensor([12.0]))
    # Two ranks that each interrupted: a stop, not a final one.
    assert reduced[STOP_REQUESTED].item() == 2.0 and not is_final_vote(reduced[STOP_REQUESTED].item(), 2)
    assert reduced[REQUEUE_REQUESTED].item() == 0.0


def test_an_algorithm_with_two_weighted_uploads_gets_a_section_for_each():
    algorithm = SimpleNamespace(weighted_uploads=("a", "b"), summed_uploads=(), weighted_short_uploads={},
                                summed_short_uploads={})
    buffer = UploadBuffer(algorithm, num_params=2, num_buffers=1, device=CPU)
    assert [name for name, _, _ in buffer.sections] == ["a", "b", "buffers", "train_loss", STOP_REQUESTED,
                                                         REQUEUE_REQUESTED, CLIENT_SECONDS]
    buffer.add({"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([2.0, 2.0])}, 0.5)
    reduced = buffer.reduced(OneRank())
    torch.testing.assert_close(reduced["a"], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(reduced["b"], torch.tensor([1.0, 1.0]))


def test_short_uploads_of_any_length_ride_the_same_all_reduce_weighted_or_summed():
    algorithm = SimpleNamespace(weighted_uploads=("update",), summed_uploads=(), weighted_short_uploads={"norm": 1},
                                summed_short_uploads={"counts": 3})
    buffer = UploadBuffer(algorithm, num_params=2, num_buffers=0, device=CPU)
    assert [(name, size) for name, size, _ in buffer.sections][:4] == [("update", 2), ("norm", 1), ("buffers", 0),
                                                                        ("counts", 3)]
    for weight, norm, counts in ((0.25, 4.0, [1.0, 0.0, 2.0]), (0.75, 8.0, [0.0, 5.0, 1.0])):
        buffer.add({"update": torch.ones(2), "norm": torch.tensor([norm]), "counts": torch.tensor(counts)}, weight)
    reduced = buffer.reduced(OneRank())
    torch.testing.assert_close(reduced["norm"], torch.tensor([0.25 * 4.0 + 0.75 * 8.0]))
    torch.testing.assert_close(reduced["counts"], torch.tensor([1.0, 5.0, 3.0]))  # summed, not weighted
