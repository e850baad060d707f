"""The validation split (data.validation) and per-client evaluation (data.per_client_eval).

Each client's held-out samples are its own, seeded, saved and checked on resume; a run without the
split trains exactly as before; val_* and client_val_accuracy_* equal a direct evaluation of the
final model, on one rank and on two.
"""

import json
from pathlib import Path

import numpy as np
import processes
import pytest
import torch
import torch.nn.functional as F
import yaml
from paths import REPOSITORY
from reference import LinearProblem, small_setup
from wandb_records import summary

from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import Callback
from fl_lightning.commands.main import main
from fl_lightning.config import DataArgs, FabricArgs
from fl_lightning.data import hold_out_validation, load_dataset, partition_indices
from fl_lightning.errors import ConfigError
from fl_lightning.experiments.plans.plan import load_plan
from fl_lightning.experiments.results.compare import compare
from fl_lightning.experiments.results.dashboard import dashboard
from fl_lightning.experiments.results.table import table
from fl_lightning.federation import setup as federation_setup
from fl_lightning.fit import fit
from fl_lightning.run_dir import check_same_experiment, experiment_digest, recorded_config
from fl_lightning.run_logging import MetricsLog, read_metrics

pytestmark = pytest.mark.slow  # end to end: the tests train runs in-process or in subprocesses
BEST_KEYS = ("best_test_accuracy", "best_test_accuracy_round", "best_test_accuracy_selected_on")
PER_CLIENT_KEYS = ("client_val_accuracy_mean", "client_val_accuracy_std", "client_val_accuracy_min",
                   "client_val_accuracy_p10")


class RecordBatches(Callback):
    """Every trained batch's training-set indices, as (round, client, [indices, ...]), in `batches`
    (one rank: the test reads it in-process)."""

    def __init__(self):
        self.batches = []

    def on_client_end(self, fabric, loop, client, uploads: dict, weight: float) -> None:
        execution = client.execution
        self.batches.append((client.round, client.client_id,
                             [execution.sample_indices[positions].tolist() for positions in execution.positions]))


def setup_with(root: Path, out_dir: Path, **data) -> dict:
    setup = small_setup(root, out_dir, rounds=2, eval_every=1, local_epochs=None, local_steps=3, batch_size=8)
    setup["data"] = DataArgs(**{**vars(setup["data"]), **data})
    return setup


def read_parts(path: Path) -> list[list[int]]:
    parts = json.loads(path.read_text())
    return [parts[str(client)] for client in range(len(parts))]


# --- the split --------------------------------------------------------------------------------------

def test_each_client_holds_out_a_seeded_fraction_of_its_own_samples():
    labels = np.random.default_rng(0).integers(0, 10, 2000)
    parts = partition_indices(labels, 20, "dirichlet", alpha=0.3, min_samples=10, seed=4)
    training, validation = hold_out_validation(parts, 0.2, seed=4)
    for part, kept, held in zip(parts, training, validation):
        assert len(held) == max(1, round(0.2 * len(part)))
        assert set(kept).isdisjoint(held) and sorted([*kept, *held]) == part.tolist()
        assert list(held) == sorted(held) and list(kept) == sorted(kept)
    again_training, again_validation = hold_out_validation(parts, 0.2, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(validation, again_validation))
    _, other_seed = hold_out_validation(parts, 0.2, seed=5)
    assert any(not np.array_equal(a, b) for a, b in zip(validation, other_seed))
    # A client's draw is its own: the other clients' samples do not change it.
    _, first_alone = hold_out_validation(parts[:1], 0.2, seed=4)
    assert np.array_equal(first_alone[0], validation[0])


def test_a_fraction_that_leaves_a_client_no_training_sample_is_refused():
    with pytest.raises(ConfigError, match=r"data.validation: .*client 1 holds 1 sample"):
        hold_out_validation([np.arange(10), np.array([10])], 0.1, seed=0)


@pytest.mark.parametrize("fraction", [1.0, 1.5])
def test_data_validation_is_a_fraction_below_one(fraction):
    with pytest.raises(ConfigError, match="data.validation: expected null or a fraction in"):
        DataArgs(name="digits", validation=fraction)


def test_per_client_evaluation_needs_a_validation_split():
    with pytest.raises(ConfigError, match="data.per_client_eval"):
        DataArgs(name="digits", per_client_eval=True)
    with pytest.raises(ConfigError, match="data.per_client_eval"):
        DataArgs(name="digits", validation=0.0, per_client_eval=True)


# --- without the split, nothing changes --------------------------------------------------------------

def test_without_a_split_the_partition_batches_and_model_are_those_of_a_run_without_the_field(cifar_root,
                                                                                              tmp_path):
    """`data.validation: 0` and the field left out are one run: the same partition.json, the same
    batches of every client, the same model bitwise, no val_* metrics and no validation.json."""
    runs = {}
    for name, data in {"without": {}, "zero": {"validation": 0.0}}.items():
        recorder = RecordBatches()
        setup = setup_with(cifar_root, tmp_path / name, **data)
        runs[name] = fit(algorithm=FedAvg(), callbacks=[recorder], **setup), recorder.batches
    (without, without_batches), (zero, zero_batches) = runs["without"], runs["zero"]
    assert torch.equal(without, zero)
    assert without_batches == zero_batches and len(without_batches) == 2 * 3
    train, _ = load_dataset("cifar10", cifar_root)
    expected = partition_indices(train.labels.numpy(), 5, "dirichlet", alpha=1.0, min_samples=10, seed=3)
    for name in runs:
        assert read_parts(tmp_path / name / "partition.json") == [p.tolist() for p in expected]
        assert not (tmp_path / name / "validation.json").exists()
        assert all(not key.startswith(("val_", "client_val_")) for row in read_metrics(tmp_path / name) for key in row)
    assert recorded_config(tmp_path / "zero")["data"]["validation"] is None


def test_a_run_recorded_before_the_split_existed_keeps_its_folder_and_resumes(cifar_root, tmp_path):
    fit(algorithm=FedAvg(), **setup_with(cifar_root, tmp_path / "run"))
    config = recorded_config(tmp_path / "run")
    before_the_field = json.loads(json.dumps(config))
    del before_the_field["data"]["validation"], before_the_field["data"]["per_client_eval"]
    assert experiment_digest(before_the_field) == experiment_digest(config)
    assert check_same_experiment(before_the_field, config, "config.yaml", tmp_path / "run") == {}
    with_split = json.loads(json.dumps(config))
    with_split["data"]["validation"] = 0.1
    assert experiment_digest(with_split) != experiment_digest(config)
    with pytest.raises(ConfigError, match=r"data.validation: None -> 0.1"):
        check_same_experiment(before_the_field, with_split, "config.yaml", tmp_path / "run")


# --- with the split ----------------------------------------------------------------------------------

def test_held_out_samples_are_saved_never_trained_on_and_evaluated(cifar_root, tmp_path):
    recorder = RecordBatches()
    fit(algorithm=FedAvg(), callbacks=[recorder], **setup_with(cifar_root, tmp_path, validation=0.25))
    train, _ = load_dataset("cifar10", cifar_root)
    full = partition_indices(train.labels.numpy(), 5, "dirichlet", alpha=1.0, min_samples=10, seed=3)
    expected_training, expected_validation = hold_out_validation(full, 0.25, seed=3)
    assert read_parts(tmp_path / "validation.json") == [p.tolist() for p in expected_validation]
    assert read_parts(tmp_path / "partition.json") == [p.tolist() for p in expected_training]
    for _, client, batches in recorder.batches:
        assert set(np.concatenate(batches)) <= set(expected_training[client].tolist())
    rows = read_metrics(tmp_path)
    assert all({"val_accuracy", "val_loss"} <= set(row) for row in rows)
    assert all(not set(PER_CLIENT_KEYS) & set(row) for row in rows)  # per-client metrics are asked for


def test_a_resume_checks_the_held_out_samples(cifar_root, tmp_path, monkeypatch):
    setup = setup_with(cifar_root, tmp_path, validation=0.25)
    fit(algorithm=FedAvg(), **setup)
    setup.update(resume="auto")
    setup["federation"].rounds = 3

    def one_sample_fewer(parts, fraction, seed):
        """The same training samples, but other held-out ones: only the validation check can see it."""
        training, validation = hold_out_validation(parts, fraction, seed)
        return training, [part[:-1] for part in validation]

    monkeypatch.setattr(federation_setup, "hold_out_validation", one_sample_fewer)
    with pytest.raises(ConfigError, match="the same validation samples"):
        fit(algorithm=FedAvg(), **setup)
    monkeypatch.undo()
    fit(algorithm=FedAvg(), **setup)
    assert [row["round"] for row in read_metrics(tmp_path)] == [1, 2, 3]


def direct_evaluation(root: Path, out_dir: Path, final: torch.Tensor) -> tuple[dict, list[float]]:
    """val_accuracy, val_loss and each client's accuracy of the final model, computed by hand in float64."""
    problem = LinearProblem(root, out_dir)
    params = final.double()
    features = problem.inputs.shape[1]
    weight, bias = params[: problem.num_classes * features].view(problem.num_classes, features), \
        params[problem.num_classes * features:]
    correct, losses, accuracies = [], [], []
    for samples in read_parts(Path(out_dir) / "validation.json"):
        samples = torch.tensor(samples)
        logits = problem.inputs[samples] @ weight.T + bias
        right = (logits.argmax(1) == problem.labels[samples]).double()
        correct.append(right)
        losses.append(F.cross_entropy(logits, problem.labels[samples], reduction="none"))
        accuracies.append(right.mean().item())
    pooled = {"val_accuracy": torch.cat(correct).mean().item(), "val_loss": torch.cat(losses).mean().item()}
    return pooled, accuracies


def check_against_direct_evaluation(root: Path, out_dir: Path, final: torch.Tensor) -> None:
    last = read_metrics(out_dir)[-1]
    pooled, accuracies = direct_evaluation(root, out_dir, final)
    assert last["val_accuracy"] == pytest.approx(pooled["val_accuracy"], abs=1e-12)
    assert last["val_loss"] == pytest.approx(pooled["val_loss"], rel=1e-5)
    expected = {"client_val_accuracy_mean": np.mean(accuracies), "client_val_accuracy_std": np.std(accuracies),
                "client_val_accuracy_min": np.min(accuracies),
                "client_val_accuracy_p10": np.percentile(accuracies, 10)}
    assert {key: last[key] for key in PER_CLIENT_KEYS} == pytest.approx(expected, abs=1e-12)
    assert len(set(accuracies)) > 1, "the clients' accuracies should differ, or the summary tests little"


def test_per_client_accuracies_are_a_direct_evaluation_of_the_model_on_each_clients_part(cifar_root, tmp_path):
    setup = setup_with(cifar_root, tmp_path, validation=0.25, per_client_eval=True)
    final = fit(algorithm=FedAvg(), **setup)
    check_against_direct_evaluation(cifar_root, tmp_path, final)


@pytest.mark.multiprocess
def test_per_client_accuracies_on_two_ranks_are_a_direct_evaluation(cifar_root, tmp_path):
    """Each rank evaluates its share of the clients (3 and 2 of 5); one all-reduce puts them together."""
    setup = setup_with(cifar_root, tmp_path, validation=0.25, per_client_eval=True)
    setup["fabric"] = FabricArgs(accelerator="cpu", devices=2, process_group_timeout_s=120)
    final = processes.call_on_ranks(2, fit, algorithm=FedAvg(), **setup)
    check_against_direct_evaluation(cifar_root, tmp_path, final)


# --- `table --at best` selects on the validation split -------------------------------------------------

def write_run(out_dir: Path, evaluations: dict[int, dict]) -> None:
    """A finished run folder of 4 rounds whose evaluation rows (round -> metrics) are `evaluations`."""
    out_dir.mkdir(parents=True)
    (out_dir / "config.yaml").write_text(yaml.safe_dump({"federation": {"rounds": 4}, "seed": 0}))
    log = MetricsLog(out_dir, history=[])
    for round_number in range(1, 5):
        log.append({"round": round_number, "train_loss": 1.0, **evaluations.get(round_number, {})})


def test_at_best_reports_the_test_metric_at_the_round_of_the_best_validation_metric(tmp_path, capsys):
    # The test set's own best (round 2) is not the round the validation split picks (round 4).
    write_run(tmp_path / "split", {2: {"test_accuracy": 0.70, "test_loss": 0.5, "val_accuracy": 0.60, "val_loss": 0.9},
                                   4: {"test_accuracy": 0.65, "test_loss": 0.8, "val_accuracy": 0.80, "val_loss": 0.4}})
    write_run(tmp_path / "no_split", {2: {"test_accuracy": 0.50, "test_loss": 0.7},
                                      4: {"test_accuracy": 0.60, "test_loss": 0.9}})
    runs = [str(tmp_path / "split"), str(tmp_path / "no_split")]
    result = table(runs, metric="test_accuracy", at="best", out=tmp_path / "out")
    ((setting,),) = {tuple(result.settings)}
    assert result.cell("split", setting).values == [pytest.approx(65.0)]
    assert result.cell("no_split", setting).values == [pytest.approx(60.0)]
    markdown = capsys.readouterr().out
    assert "at the evaluation of its best val_accuracy (model selection on the validation split" in markdown
    assert "best: selected on the test set itself, the best test_accuracy" in markdown and "no_split" in markdown
    losses = table(runs, metric="test_loss", at="best", out=tmp_path / "out")
    assert losses.cell("split", setting).values == [pytest.approx(0.8)]  # at val_loss's minimum, round 4
    assert losses.cell("no_split", setting).values == [pytest.approx(0.7)]
    capsys.readouterr()
    final = table(runs, metric="test_accuracy", at="final", out=tmp_path / "out")
    assert final.cell("split", setting).values == [pytest.approx(65.0)]
    assert "best:" not in capsys.readouterr().out




# --- one best in fit's last line, the W&B summary, compare, the dashboard and `table --at best` -------

class ValidationAgainstTheTestSet(Callback):
    """Each evaluation's val_accuracy becomes 1 - test_accuracy: a validation split that disagrees with
    the test set, so that the round it selects is the test set's worst, never its best (what a real
    split does by chance on some runs, made certain)."""

    def on_round_end(self, fabric, loop, metrics: dict) -> None:
        if "val_accuracy" in metrics:
            metrics["val_accuracy"] = 1.0 - metrics["test_accuracy"]


def write_best_plan(folder: Path, split: bool) -> Path:
    """A plan of one run: FedAvg + CONST on the digits, 4 rounds evaluated each, logged to W&B offline;
    with `split`, a validation split that disagrees with the test set."""
    configs = [str(REPOSITORY / "configs" / "quickstart.yaml"), {"model.options": {"hidden": 16, "depth": 1}},
               {"federation.rounds": 4, "federation.local_steps": 2, "federation.eval_every": 1},
               {"checkpoint.every": 4, "logger.progress_bar": False, "logger.wandb_mode": "offline"}]
    if split:
        configs.append({"data.validation": 0.2,
                        "callbacks": [{"class_path": f"{__name__}.{ValidationAgainstTheTestSet.__name__}"}]})
    plan = {"name": "best", "configs": configs, "seeds": [0], "settings": {"alpha": {"0.5": [{"data.alpha": 0.5}]}},
            "methods": {"FedAvg + CONST": [str(REPOSITORY / "configs" / name) for name in ("algorithms/fedavg.yaml",
                                                                                      "const.yaml")]}}
    (folder / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    return folder / "plan.yaml"


@pytest.mark.parametrize("split", [True, False], ids=["validation split", "no split"])
def test_fit_the_wandb_summary_compare_the_dashboard_and_table_report_one_best(split, tmp_path, capsys):
    """With a validation split each reports the test accuracy at the round of the best val_accuracy (the
    earliest on a tie) and says so; without one, the test set's own best, and each says that the test
    set selected it."""
    plan_file, runs_root = write_best_plan(tmp_path, split), tmp_path / "runs"
    (point,) = load_plan(plan_file, runs_root=runs_root).grid()
    main(point.fit_arguments())
    last_line = capsys.readouterr().out.splitlines()[-1]
    evaluations = [row for row in read_metrics(point.out_dir) if "test_accuracy" in row]
    selected_on = "val_accuracy" if split else "test_accuracy"
    chosen = max(evaluations, key=lambda row: row[selected_on])  # the first of the maxima: the earliest round
    test_sets_own = max(evaluations, key=lambda row: row["test_accuracy"])
    assert (chosen["round"] != test_sets_own["round"]) == split, "the split should choose another round"
    says = "at the best val_accuracy" if split else "selected on the test set: no validation split"
    note = ("at the evaluation of its best val_accuracy (model selection on the validation split" if split
            else "best: selected on the test set itself, the best test_accuracy over the evaluations")

    assert f"best {chosen['test_accuracy']:.4f} (round {chosen['round']}, {says}); outputs in" in last_line
    (run_file,) = (point.out_dir / "wandb").glob("offline-run-*/run-*.wandb")
    recorded = summary(run_file)
    best = (chosen["test_accuracy"], chosen["round"], selected_on)
    assert tuple(recorded[key] for key in BEST_KEYS) == best
    assert recorded.get("best_val_accuracy") == (chosen["val_accuracy"] if split else None)
    (compared,) = compare(str(point.out_dir), plan=plan_file, runs_root=runs_root)
    assert tuple(compared[key] for key in BEST_KEYS) == best and compared["method"] == "FedAvg + CONST"
    assert note in capsys.readouterr().out.splitlines()[-1]
    tabulated = table(str(plan_file), at="best", percent=False, runs_root=runs_root, out=tmp_path / "table")
    assert tabulated.cell(point.method, point.setting_name).values == [chosen["test_accuracy"]]
    assert any(note in line for line in tabulated.notes)
    # The dashboard shows the summary: bars of best_test_accuracy, titled with how it was selected, and
    # its round in the runs table.
    spec = dashboard(plan_file, offline=True, runs_root=runs_root, out=tmp_path / "dashboard.json")
    (section,) = spec["sections"]
    (bar,) = [panel for panel in section["panels"] if panel.get("metrics") == [BEST_KEYS[0]]]
    assert bar["title"] == f"best_test_accuracy ({says})"
    assert {f"summary:{key}" for key in BEST_KEYS} <= set(section["columns"])
