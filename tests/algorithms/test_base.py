"""What every algorithm shares: its short name registered (and a renamed one's former names still
answered to), its hyper-parameters checked as config errors naming the field and frozen once built (a
run's state is the run's), and a stateful method's per-client state (SCAFFOLD, FedDyn, MOON) kept
across ranks and resumes."""

import json
import pickle

import processes
import pytest
import torch
from paths import QUICKSTART
from reference import PROJECTION, moon_setup, returning, sampled, small_setup

from fl_lightning.algorithms import SHORT_NAMES
from fl_lightning.algorithms.fedavg_client_momentum import FedAvgClientMomentum
from fl_lightning.algorithms.fedavg_server_momentum import FedAvgServerMomentum
from fl_lightning.algorithms.fedcm import FedCM
from fl_lightning.algorithms.feddyn import FedDyn
from fl_lightning.algorithms.fednova import FedNova
from fl_lightning.algorithms.fedprox import FedProx
from fl_lightning.algorithms.fedsam import FedSAM
from fl_lightning.algorithms.moon import MOON
from fl_lightning.algorithms.scaffold import SCAFFOLD
from fl_lightning.cli.parser import parse_command_line
from fl_lightning.commands.main import command_parser
from fl_lightning.config import ClientOptimizerArgs, FabricArgs, FederationArgs, ModelArgs
from fl_lightning.configurable import class_path_of, resolve_dotted_path
from fl_lightning.constraints import CONST
from fl_lightning.errors import ConfigError
from fl_lightning.federation.setup import RunSettings
from fl_lightning.fit import fit, fit_config
from fl_lightning.participation import Cyclic
from fl_lightning.run_dir import check_same_experiment, experiment_digest
from fl_lightning.server_optimizers import FedAdam, ServerSGD

STATEFUL = {
    "scaffold": (SCAFFOLD, "linear"),
    "feddyn": (lambda: FedDyn(alpha=0.1), "linear"),
    "moon": (lambda: MOON(projection_dim=PROJECTION), "mlp"),
}


def stateful_setup(name, root, out_dir, **federation):
    setup = moon_setup(root, out_dir, **federation) if STATEFUL[name][1] == "mlp" else small_setup(
        root, out_dir, **federation)
    setup["client_optimizer"] = ClientOptimizerArgs(lr=0.05, momentum=0.5)
    return setup


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", STATEFUL)
def test_two_ranks_give_the_same_model_as_one(cifar_root, tmp_path, name):
    make = STATEFUL[name][0]
    setup = stateful_setup(name, cifar_root, tmp_path / "one", rounds=3)
    assert returning(setup)
    single = fit(algorithm=make(), **setup)
    setup.update(out_dir=tmp_path / "two", fabric=FabricArgs(accelerator="cpu", devices=2, process_group_timeout_s=120))
    double = processes.call_on_ranks(2, fit, algorithm=make(), **setup)
    torch.testing.assert_close(double, single, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", STATEFUL)
def test_resume_from_mid_run_checkpoint_reproduces_the_uninterrupted_run(cifar_root, tmp_path, name):
    make = STATEFUL[name][0]

    def run(out_dir, rounds, resume):
        setup = stateful_setup(name, cifar_root, out_dir, rounds=rounds, eval_every=1)
        setup["resume"] = resume
        return fit(algorithm=make(), **setup)

    setup = stateful_setup(name, cifar_root, tmp_path, rounds=4)
    assert set(sampled(0, setup) + sampled(1, setup)) & set(sampled(2, setup) + sampled(3, setup))  # state is read back
    uninterrupted = run(tmp_path / "a", 4, None)
    run(tmp_path / "b", 2, None)
    resumed = run(tmp_path / "b", 4, "auto")
    torch.testing.assert_close(resumed, uninterrupted, rtol=0, atol=0)


def participating_as_it_happens(name, root, out_dir, **federation):
    """A stateful method's setup under cyclic participation (2 groups) with a third of the uploads lost."""
    return stateful_setup(name, root, out_dir, participation=Cyclic(groups=2), dropout=0.35, **federation)


@pytest.mark.multiprocess
def test_two_ranks_give_the_same_model_and_the_same_clients_as_one_under_cyclic_participation_and_dropouts(
        cifar_root, tmp_path):
    setup = participating_as_it_happens("scaffold", cifar_root, tmp_path / "one", rounds=4)
    single = fit(algorithm=SCAFFOLD(), **setup)
    setup.update(out_dir=tmp_path / "two", fabric=FabricArgs(accelerator="cpu", devices=2, process_group_timeout_s=120))
    double = processes.call_on_ranks(2, fit, algorithm=SCAFFOLD(), **setup)
    torch.testing.assert_close(double, single, rtol=1e-5, atol=1e-6)
    counts = [[{k: v for k, v in row.items() if k.startswith("clients_")} for row in metrics_rows(tmp_path / run)]
              for run in ("one", "two")]
    assert counts[0] == counts[1]
    assert sum(row["clients_dropped"] for row in counts[0]) > 0
    assert all(row["clients_online"] < setup["federation"].num_clients for row in counts[0])


@pytest.mark.slow
def test_resume_under_cyclic_participation_and_dropouts_reproduces_the_uninterrupted_run(cifar_root, tmp_path):
    def run(out_dir, rounds, resume):
        setup = participating_as_it_happens("feddyn", cifar_root, out_dir, rounds=rounds, eval_every=1)
        setup["resume"] = resume
        return fit(algorithm=FedDyn(alpha=0.1), **setup)

    uninterrupted = run(tmp_path / "a", 4, None)
    run(tmp_path / "b", 2, None)
    resumed = run(tmp_path / "b", 4, "auto")
    torch.testing.assert_close(resumed, uninterrupted, rtol=0, atol=0)
    assert [row["clients_reported"] for row in metrics_rows(tmp_path / "b")] == [
        row["clients_reported"] for row in metrics_rows(tmp_path / "a")]


def metrics_rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


RENAMED = [(FedAvgClientMomentum, "fedavg_m", "FedAvgMomentum", "fl_lightning.algorithms.fedavg_m.FedAvgMomentum"),
           (FedAvgServerMomentum, "fedavgm", "FedAvgM", "fl_lightning.algorithms.fedavgm.FedAvgM")]
RENAMED_IDS = ["FedAvgClientMomentum", "FedAvgServerMomentum"]


@pytest.mark.parametrize("cls, short_name, class_name, class_path", RENAMED, ids=RENAMED_IDS)
def test_a_renamed_algorithm_answers_to_its_former_names(cls, short_name, class_name, class_path, tmp_path):
    config = tmp_path / "algorithm.yaml"
    config.write_text(f"algorithm:\n  class_path: {short_name}\n")
    parser = command_parser()
    for line in (["--algorithm", short_name], ["--algorithm", class_name], ["--algorithm", class_path],
                 ["--config", str(config)]):
        parsed = parser.instantiate(parse_command_line(["fit", "--config", QUICKSTART, *line], parser))
        assert type(parsed.fit.algorithm) is cls, line
    assert resolve_dotted_path(class_path) is cls


@pytest.mark.parametrize("cls, short_name, class_name, class_path", RENAMED, ids=RENAMED_IDS)
def test_runs_recorded_under_a_former_class_path_stay_the_same_experiment_in_the_same_folder(
        cls, short_name, class_name, class_path, tmp_path):
    """A run records the class's own path now; one recorded before the rename is the same experiment to a
    resume and to a sweep's check of its folder, and a run's default folder, named by the former short
    name and the digest, is the one it had."""
    settings = RunSettings(cls(), federation=FederationArgs(local_steps=2))
    checked = fit_config(settings, out_dir=None, resume="auto", overwrite=False)
    assert checked.config["algorithm"]["class_path"] == class_path_of(cls)
    recorded = {**checked.config, "algorithm": {**checked.config["algorithm"], "class_path": class_path}}
    check_same_experiment(recorded, checked.config, "config.yaml", tmp_path)  # raises DifferentExperiment
    data, model = settings.data.name, settings.model.name
    assert checked.out_dir.name == f"{short_name}-{data}-{model}-seed0-{experiment_digest(recorded)}"
    assert cls.method_name() == checked.method == short_name


def test_all_baselines_register_their_short_names():
    assert {"fedavg_server_momentum": FedAvgServerMomentum, "fedavg_client_momentum": FedAvgClientMomentum,
            "fedcm": FedCM, "fedprox": FedProx, "fedsam": FedSAM, "scaffold": SCAFFOLD, "feddyn": FedDyn,
            "fednova": FedNova, "moon": MOON}.items() <= SHORT_NAMES.items()


@pytest.mark.parametrize("make, field", [
    (lambda: FedProx(mu=-0.1), "algorithm.init_args.mu"),
    (lambda: FedSAM(rho=-0.1), "algorithm.init_args.rho"),
    (lambda: FedAvgServerMomentum(server_momentum=1.0), "algorithm.init_args.server_momentum"),
    (lambda: FedAvgServerMomentum(server_momentum=-0.1), "algorithm.init_args.server_momentum"),
    (lambda: FedAvgClientMomentum(beta=0.0), "algorithm.init_args.beta"),
    (lambda: FedAvgClientMomentum(beta=1.5), "algorithm.init_args.beta"),
    (lambda: FedCM(alpha=0.0), "algorithm.init_args.alpha"),
    (lambda: FedCM(alpha=-0.2), "algorithm.init_args.alpha"),
    (lambda: FedDyn(alpha=0.0), "algorithm.init_args.alpha"),
    (lambda: FedDyn(alpha=-0.01), "algorithm.init_args.alpha"),
    (lambda: MOON(mu=-1.0), "algorithm.init_args.mu"),
    (lambda: MOON(tau=0.0), "algorithm.init_args.tau"),
    (lambda: MOON(tau=-0.5), "algorithm.init_args.tau"),
    (lambda: MOON(projection_dim=0), "algorithm.init_args.projection_dim"),
])
def test_bad_hyperparameters_are_config_errors(make, field):
    with pytest.raises(ConfigError) as error:
        make()
    assert error.value.field_name == field




def configured_objects():
    """A stateful algorithm, a server optimizer that keeps moments and a constraint, built as a config builds them."""
    return SCAFFOLD(), FedAdam(lr=0.05), CONST()


def test_configured_objects_serve_two_fits_in_one_process_and_keep_nothing_of_either(cifar_root, tmp_path):
    """The run's state lives in the run: the second fit with the same configured objects trains, bitwise,
    what a fit with fresh objects trains, and fit leaves the objects as they were built."""
    configured = configured_objects()
    built = [dict(vars(one)) for one in configured]

    def run(name, objects):
        algorithm, server_optimizer, constraint = objects
        setup = small_setup(cifar_root, tmp_path / name, rounds=2)
        setup.update(model=ModelArgs(name="linear", bias=False), client_optimizer=ClientOptimizerArgs(lr=0.05,
                                                                                                      momentum=0.5))
        return fit(algorithm=algorithm, server_optimizer=server_optimizer, constraint=constraint, **setup)

    first, second = run("first", configured), run("second", configured)
    assert [vars(one) for one in configured] == built
    fresh = run("fresh", configured_objects())
    assert torch.equal(first, fresh) and torch.equal(second, fresh)


@pytest.mark.parametrize("make", [SCAFFOLD, FedAvgServerMomentum, lambda: MOON(projection_dim=PROJECTION), ServerSGD,
                                  FedAdam, CONST],
                         ids=["SCAFFOLD", "FedAvgServerMomentum", "MOON", "ServerSGD", "FedAdam", "CONST"])
def test_algorithms_server_optimizers_and_constraints_are_frozen_once_built(make):
    """Hyper-parameters only: no attribute is written or removed after construction, also after the
    pickling that hands them to spawned ranks."""
    for configured in (make(), pickle.loads(pickle.dumps(make()))):
        with pytest.raises(AttributeError, match="frozen once built"):
            configured.server_state = {}
        with pytest.raises(AttributeError, match="frozen once built"):
            del configured.init_args
        assert configured.init_args == make().init_args
