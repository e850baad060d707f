"""Who is online in each round (fl_lightning/participation.py): each model's draws over many rounds
against its definition (an online frequency per client within a binomial interval of its probability,
cyclic groups exactly), the same draws for the same seed, and bad settings refused naming the field."""

import json
import math

import numpy as np
import pytest
import torch
from paths import QUICKSTART
from reference import small_setup

from fl_lightning.algorithms import CTPFL, FedAvg
from fl_lightning.cli.parser import parse_command_line
from fl_lightning.commands.main import command_parser
from fl_lightning.config import FederationArgs
from fl_lightning.errors import ConfigError
from fl_lightning.federation.aggregation import local_steps_done, participation_draws, round_clients
from fl_lightning.fit import fit
from fl_lightning.participation import SHORT_NAMES, Availability, Cyclic, Stragglers, Trace, Uniform

ROUNDS = 2000


def draws_of(seed):
    return participation_draws(seed)


def online_counts(participation, num_clients, rounds=ROUNDS, seed=0):
    counts = np.zeros(num_clients)
    for r in range(rounds):
        counts[participation.online(r, num_clients, draws_of(seed))] += 1
    return counts


def within_binomial_interval(count, trials, probability, z=4.5):
    """Whether `count` successes of `trials` lie within z standard deviations of the binomial mean."""
    spread = z * math.sqrt(trials * probability * (1 - probability))
    return abs(count - trials * probability) <= spread + 1e-9


def test_every_model_has_its_short_name():
    assert SHORT_NAMES == {"uniform": Uniform, "availability": Availability, "cyclic": Cyclic, "trace": Trace}


def test_the_draws_made_once_share_no_stream_with_any_rounds():
    # A Beta's probabilities drawn from round 0's stream would be correlated with round 0's uniforms.
    draws = participation_draws(4)
    once = draws().random(8)
    assert all(not np.array_equal(once, draws(r).random(8)) for r in range(3))


def test_uniform_puts_every_client_online_every_round():
    assert all(list(Uniform().online(r, 7, draws_of(0))) == list(range(7)) for r in range(5))


@pytest.mark.parametrize("probability", [0.1, 0.5, 0.9])
def test_availability_puts_each_client_online_with_its_probability(probability):
    counts = online_counts(Availability(probability=probability), 20)
    assert all(within_binomial_interval(count, ROUNDS, probability) for count in counts), counts
    assert len(set(counts)) > 1  # independent clients, not one draw for all


def test_availability_with_probability_one_puts_everyone_online():
    assert online_counts(Availability(probability=1.0), 6, rounds=50).tolist() == [50] * 6


def test_availability_from_a_beta_draws_each_clients_probability_once():
    participation, num_clients = Availability(beta=(2.0, 3.0)), 30
    probabilities = participation.probabilities(num_clients, draws_of(0))
    np.testing.assert_array_equal(probabilities, participation.probabilities(num_clients, draws_of(0)))
    assert not np.array_equal(probabilities, participation.probabilities(num_clients, draws_of(1)))
    assert np.ptp(probabilities) > 0.3  # the clients differ
    counts = online_counts(participation, num_clients)
    assert all(within_binomial_interval(c, ROUNDS, p) for c, p in zip(counts, probabilities)), (counts, probabilities)


def test_cyclic_groups_are_fixed_and_online_in_turn():
    participation, num_clients, groups = Cyclic(groups=3), 10, 3
    split = participation.client_groups(num_clients, draws_of(0))
    assert sorted(c for group in split for c in group) == list(range(num_clients))
    assert sorted(len(group) for group in split) == [3, 3, 4]
    for r in range(12):
        assert participation.online(r, num_clients, draws_of(0)) == split[r % groups]


def test_cyclic_groups_are_a_random_split_of_the_run():
    # Not the ids in order: a group holds clients whatever their place in the data split.
    assert Cyclic(groups=2).client_groups(10, draws_of(0)) != [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_trace_repeats_its_lines(tmp_path):
    trace = tmp_path / "online.txt"
    trace.write_text("0 3, 2\n\n1,1,4\n")
    participation = Trace(path=str(trace))
    assert [participation.online(r, 5, draws_of(0)) for r in range(6)] == [[0, 2, 3], [], [1, 4]] * 2


def federation(**settings):
    return FederationArgs(num_clients=10, clients_per_round=3, local_steps=1, **settings)


@pytest.mark.parametrize("make, field", [
    (lambda: Availability(probability=0.0), "federation.participation.init_args.probability"),
    (lambda: Availability(probability=1.5), "federation.participation.init_args.probability"),
    (lambda: Availability(probability=float("nan")), "federation.participation.init_args.probability"),
    (lambda: Availability(), "federation.participation.init_args"),
    (lambda: Availability(probability=0.5, beta=(1.0, 1.0)), "federation.participation.init_args"),
    (lambda: Availability(beta=(0.0, 1.0)), "federation.participation.init_args.beta"),
    (lambda: Cyclic(groups=0), "federation.participation.init_args.groups"),
    (lambda: Trace(path="no/such/trace.txt"), "federation.participation.init_args.path"),
])
def test_bad_participation_settings_are_refused_naming_the_field(make, field):
    with pytest.raises(ConfigError) as refused:
        make()
    assert refused.value.field_name == field


def test_settings_that_do_not_fit_the_federation_are_refused_before_any_round(tmp_path):
    with pytest.raises(ConfigError) as refused:
        federation(participation=Cyclic(groups=11)).validate()
    assert refused.value.field_name == "federation.participation.init_args.groups" and "(10)" in str(refused.value)
    trace = tmp_path / "online.txt"
    trace.write_text("1 2\n3 10\n")
    with pytest.raises(ConfigError) as refused:
        federation(participation=Trace(path=str(trace))).validate()
    assert refused.value.field_name == "federation.participation.init_args.path" and "line 2" in str(refused.value)
    trace.write_text("1 x\n")
    with pytest.raises(ConfigError, match="line 1"):
        Trace(path=str(trace))
    with pytest.raises(ConfigError) as refused:
        FederationArgs(num_clients=10, clients_per_round=11, local_steps=1).validate()
    assert refused.value.field_name == "federation.clients_per_round"
    with pytest.raises(ConfigError) as refused:
        federation(dropout=1.0).validate()
    assert refused.value.field_name == "federation.dropout"
    federation(participation=Cyclic(groups=10), dropout=0.5).validate()


@pytest.mark.parametrize("line", [
    ["--federation.participation", "cyclic", "--federation.participation.groups", "3"],
    ["--federation.participation", "Cyclic", "--federation.participation.groups", "3"],
    ["--federation.participation", "{class_path: fl_lightning.participation.Cyclic, init_args: {groups: 3}}"],
    ["--config", "participation.yaml"],
])
def test_a_participation_model_is_chosen_like_an_algorithm(line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "participation.yaml").write_text(
        "federation:\n  participation: {class_path: cyclic, init_args: {groups: 3}}\n")
    parser = command_parser()
    parsed = parser.instantiate(parse_command_line(["fit", "--config", str(QUICKSTART), *line], parser))
    participation = parsed.fit.federation.participation
    assert type(participation) is Cyclic and participation.groups == 3


def test_uniform_participation_is_one_setting_however_it_is_said():
    # null and uniform are one experiment: one value recorded, one run folder.
    parser = command_parser()
    for line in ([], ["--federation.participation", "uniform"], ["--federation.participation", "null"]):
        parsed = parser.instantiate(parse_command_line(["fit", "--config", str(QUICKSTART), *line], parser))
        assert parsed.fit.federation.participation is None and parsed.fit.federation.dropout == 0, line
    assert isinstance(FederationArgs(participation=Uniform()).online_clients, Uniform)
    assert FederationArgs(participation=Uniform()).participation is None


def test_the_participation_changes_neither_the_data_split_nor_the_mini_batches(cifar_root, tmp_path):
    # With every client online, availability draws the clients uniform draws: the same model, bit for
    # bit, though it took its own draws; cyclic groups train on the same split.
    def run(name, **federation):
        setup = small_setup(cifar_root, tmp_path / name, rounds=2, local_epochs=1, batch_size=20, **federation)
        return fit(algorithm=FedAvg(), **setup)

    uniform = run("uniform")
    assert torch.equal(run("always_available", participation=Availability(probability=1.0)), uniform)
    run("cyclic", participation=Cyclic(groups=2))
    assert (tmp_path / "cyclic" / "partition.json").read_text() == (tmp_path / "uniform" / "partition.json").read_text()


def test_a_straggler_keeps_its_speed_class_and_does_a_jittered_share_of_its_steps():
    stragglers, planned = Stragglers(speeds=(0.25, 0.5, 1.0), jitter=0.4), 20
    for client in range(30):
        classes = set()
        for round_index in range(20):
            speed_draw = np.random.default_rng([7, client])  # one generator per client for the run
            steps = stragglers.steps(planned, speed_draw, np.random.default_rng([7, client, round_index]))
            speed = stragglers.speeds[np.random.default_rng([7, client]).integers(3)]
            assert math.ceil(planned * speed * 0.6 - 1e-9) <= steps <= math.ceil(planned * speed - 1e-9)
            classes.add(speed)
        assert len(classes) == 1
    assert Stragglers(speeds=(0.01,)).steps(20, np.random.default_rng(0), np.random.default_rng(1)) == 1
    assert Stragglers(deadline=3).steps(20, np.random.default_rng(0), np.random.default_rng(1)) == 3
    assert Stragglers().steps(20, np.random.default_rng(0), np.random.default_rng(1)) == 20


@pytest.mark.parametrize("settings, field", [
    (dict(speeds=()), "speeds"), (dict(speeds=(0.5, 1.5)), "speeds"), (dict(speeds=(0.0,)), "speeds"),
    (dict(jitter=1.0), "jitter"), (dict(jitter=-0.1), "jitter"), (dict(deadline=0), "deadline"),
])
def test_bad_straggler_settings_are_refused_naming_the_field(settings, field):
    with pytest.raises(ConfigError) as refused:
        Stragglers(**settings)
    assert refused.value.field_name == f"federation.stragglers.init_args.{field}"


def test_ctpfl_refuses_stragglers_saying_why(cifar_root, tmp_path):
    setup = small_setup(cifar_root, tmp_path, local_steps=2, local_epochs=None, batch_size=10,
                        stragglers=Stragglers(deadline=1))
    with pytest.raises(ConfigError, match="same K points") as refused:
        fit(algorithm=CTPFL(), **setup)
    assert refused.value.field_name == "federation.stragglers"


def test_each_round_records_who_took_part_and_the_steps_they_did(cifar_root, tmp_path):
    stragglers = Stragglers(speeds=(0.5, 1.0), jitter=0.5)
    fit(algorithm=FedAvg(), **small_setup(cifar_root, tmp_path, rounds=4, local_steps=6, local_epochs=None,
                                          batch_size=10, stragglers=stragglers, participation=Cyclic(groups=2),
                                          dropout=0.4))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    federation = FederationArgs(num_clients=5, clients_per_round=3, local_steps=6, stragglers=stragglers,
                                participation=Cyclic(groups=2), dropout=0.4)
    for round_index, row in enumerate(rows):
        taking_part = round_clients(3, round_index, federation)
        assert {key: row[key] for key in taking_part.counts()} == taking_part.counts()
        steps = [local_steps_done(3, round_index, c, federation, 6) for c in taking_part.reported]
        assert (row["steps_mean"], row["steps_min"]) == (sum(steps) / len(steps), min(steps))
    assert any(row["steps_min"] < 6 for row in rows)
