"""Every point's dataset checked in its layout before anything runs, is submitted or timed: each folder once,
reading none of it, a missing or partial one refused, a download allowed to fetch it."""

import pytest
from commands import run_sweep
from paths import EXAMPLES, QUICKSTART
from sweeps import dataset_settings, stand_in_sbatch, write_plan

from fl_lightning.commands.main import main
from fl_lightning.data import datasets
from fl_lightning.data.datasets import check_dataset
from fl_lightning.experiments.sweeps import data_check

pytestmark = pytest.mark.usefixtures("outside_slurm")  # a sweep here never submits or runs as a task


@pytest.mark.parametrize("where", [[], ["--slurm"], ["--estimate"]], ids=["locally", "slurm", "estimate"])
def test_a_missing_or_partial_dataset_is_refused_before_anything_runs_or_is_submitted(where, tmp_path, capsys,
                                                                                     monkeypatch):
    record = stand_in_sbatch(tmp_path, monkeypatch)
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [], "FedProx": [{"algorithm": "fedprox"}]},
                      settings=dataset_settings(tmp_path))
    runs = tmp_path / "runs"
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(runs), *where)
    assert status == 2 and "timed" not in out and "array job" not in out
    assert err.splitlines() == [
        "error: data.root: expected the dataset of every grid point in its layout under its data.root before anything "
        "runs or is submitted (put it there, fetch it with fl-lightning data, or set data.download: true where the "
        f"runs can reach the network), got {plan}, where",
        "  cifar10 for 4 point(s), first [0] FedAvg | dataset-cifar10 | seed 0: data.root: expected "
        f"{tmp_path}/nothing/cifar-10-batches-py/ to hold data_batch_1..5 and test_batch (CIFAR-10, python version) "
        f"(or set data.download: true), got '{tmp_path}/nothing'",
        f"  cifar100 for 4 point(s), first [4] FedAvg | dataset-cifar100 | seed 0: data.root: expected "
        f"{tmp_path}/partial/cifar-100-python/ to hold train and test (CIFAR-100, python version), got "
        f"'{tmp_path}/partial, whose cifar-100-python/ lacks test'"]
    assert not record.exists() and not runs.exists()  # nothing submitted, nothing run


def test_each_dataset_folder_is_checked_once_reading_none_of_it_and_a_download_may_fetch_it(
        tmp_path, capsys, monkeypatch, cifar_root):
    record = stand_in_sbatch(tmp_path, monkeypatch)
    checked = []
    monkeypatch.setattr(data_check, "check_dataset", lambda name, root, download: checked.append(
        (name, str(root), download)) or check_dataset(name, root, download))
    monkeypatch.setattr(datasets, "_read_cifar_batch", None)  # no point's data is read
    settings = dataset_settings(tmp_path)
    settings["dataset"]["cifar10"][0]["data.root"] = str(cifar_root)
    settings["dataset"]["cifar100"][0].update({"data.root": str(tmp_path / "empty"), "data.download": True})
    plan = write_plan(tmp_path / "plan.yaml", {"FedAvg": [], "FedProx": [{"algorithm": "fedprox"}]},
                      settings=settings)
    status, out, err = run_sweep(capsys, "--plan", str(plan), "--runs_root", str(tmp_path / "runs"), "--slurm")
    assert status == 0, err
    assert "Submitted batch job 42" in out and record.exists()
    # Absent, CIFAR-100 is allowed: its runs fetch it.
    assert checked == [("cifar10", str(cifar_root), False), ("cifar100", str(tmp_path / "empty"), True)]


@pytest.mark.parametrize("plan_options", [["configs/plans/smoke.yaml"], ["--plan", "configs/plans/smoke.yaml"]])
def test_a_plan_and_a_fit_command_line_together_are_refused_as_such(plan_options, capsys, in_repository_root):
    with pytest.raises(SystemExit) as exited:
        main(["data", *plan_options, "--config", QUICKSTART])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: plan: expected a plan (fl-lightning data PLAN) or a fit command line (fl-lightning data --config "
        "FILE ...), not both, got 'configs/plans/smoke.yaml and --config'"]


def test_a_loader_of_the_users_is_named_as_given(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    main(["data", "--config", QUICKSTART, "--data.name", "my_dataset.load_shapes"])
    assert capsys.readouterr().out == ("my_dataset.load_shapes: your loader, with data.root data: 2000 train and 500 "
                                       "test images of 3x16x16, 4 classes\n")
