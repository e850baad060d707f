"""The run folder: a resume continues only the same experiment, a folder holds one run at a time,
and damaged or leftover files are caught before training."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from quick_runs import BASE, ROUNDS, fit, folder_snapshot, refused

from fl_lightning.checkpoint import checkpoint_dir, load_checkpoint, numbered_checkpoints
from fl_lightning.commands.main import main
from fl_lightning.errors import ConfigError
from fl_lightning.run_dir import check_same_experiment, default_out_dir
from fl_lightning.run_logging import read_metrics

pytestmark = pytest.mark.slow  # end to end: the tests train runs in-process or in subprocesses


CHANGES = {
    "algorithm": (["--algorithm", "fedprox"], "algorithm.class_path"),
    "algorithm argument": (["--algorithm", "fedprox", "--algorithm.mu", "0.1"], "algorithm.class_path"),
    "model": (["--model.options", "{hidden: 32, depth: 1}"], "model.options.hidden"),
    "dirichlet alpha": (["--data.alpha", "0.3"], "data.alpha"),
    "partition": (["--data.partition", "iid"], "data.partition"),
    "clients": (["--federation.num_clients", "12"], "federation.num_clients"),
    "local steps": (["--federation.local_steps", "3"], "federation.local_steps"),
    "client lr": (["--client_optimizer.lr", "0.1"], "client_optimizer.lr"),
    "server optimizer": (["--server_optimizer", "FedAdam"], "server_optimizer.class_path"),
    "server lr": (["--server_optimizer.lr", "0.5"], "server_optimizer.init_args.lr"),
    "seed": (["--seed", "1"], "seed"),
    "precision": (["--fabric.precision", "64-true"], "fabric.precision"),
}


@pytest.mark.parametrize("extra, field_name", CHANGES.values(), ids=CHANGES.keys())
def test_resume_with_a_changed_experiment_refuses_naming_the_field(extra, field_name, run_copy, capsys):
    before = folder_snapshot(run_copy)
    stderr = refused(capsys, run_copy, *extra)
    assert f"  {field_name}: " in stderr and " -> " in stderr, stderr
    assert "another out_dir" in stderr
    assert folder_snapshot(run_copy) == before  # nothing was written


def test_changed_lr_after_a_kill_before_any_checkpoint_is_refused_from_config_yaml(run_copy, capsys):
    shutil.rmtree(checkpoint_dir(run_copy))
    stderr = refused(capsys, run_copy, "--client_optimizer.lr", "0.2")
    assert "client_optimizer.lr: 0.05 -> 0.2" in stderr and "config.yaml" in stderr


def test_more_rounds_continue_the_run_and_fewer_are_refused(run_copy, capsys):
    stderr = refused(capsys, run_copy, "--federation.rounds", "2")
    assert "federation.rounds: expected at least 4" in stderr
    main([*BASE, "--federation.rounds", "6", "--resume", "auto", "--out_dir", str(run_copy),
          "--logger.progress_bar", "true", "--checkpoint.keep", "3"])
    assert "resuming with changed settings: checkpoint.keep 2 -> 3, federation.rounds 4 -> 6" in capsys.readouterr().err
    assert [row["round"] for row in read_metrics(run_copy)] == [1, 2, 3, 4, 5, 6]


def test_another_client_path_continues_the_run(run_copy, capsys):
    """How a rank computes its clients is not part of the experiment: the paths agree to rounding."""
    main([*BASE, "--federation.rounds", "5", "--resume", "auto", "--out_dir", str(run_copy),
          "--compute.client_path", "grouped"])
    assert "compute.client_path 'auto' -> 'grouped'" in capsys.readouterr().err
    assert [row["round"] for row in read_metrics(run_copy)] == [1, 2, 3, 4, 5]


def test_a_run_that_recorded_a_retired_setting_continues_and_other_removed_settings_are_refused():
    """CTP-FL's `vectorise` chose how gradients were computed; runs that recorded it continue."""
    requested = {"algorithm": {"class_path": "fl_lightning.algorithms.ctpfl.CTPFL", "init_args": {"span": None}}}
    recorded = {"algorithm": {"class_path": "fl_lightning.algorithms.ctpfl.CTPFL",
                              "init_args": {"span": None, "vectorise": False}}}
    assert check_same_experiment(recorded, requested, "config.yaml", Path("runs/x")) == {}
    recorded["algorithm"]["init_args"]["clip_norm"] = 1.0
    with pytest.raises(ConfigError, match=r"algorithm.init_args.clip_norm: 1.0 -> None"):
        check_same_experiment(recorded, requested, "config.yaml", Path("runs/x"))


def test_a_finished_run_trains_nothing_when_run_again(run_copy, capsys):
    before = folder_snapshot(run_copy)
    fit(run_copy)
    assert "holds a finished run (round 4); nothing to train" in capsys.readouterr().err
    assert folder_snapshot(run_copy) == before


def test_fresh_start_in_a_folder_with_results_refuses_unless_overwrite(run_copy, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*BASE, "--federation.rounds", "2", "--resume", "null", "--out_dir", str(run_copy)])
    assert exited.value.code == 2
    assert "overwrite: true to replace it" in capsys.readouterr().err
    main([*BASE, "--federation.rounds", "2", "--resume", "null", "--overwrite", "true", "--out_dir", str(run_copy)])
    assert [row["round"] for row in read_metrics(run_copy)] == [1, 2]
    assert [p.name for p in numbered_checkpoints(checkpoint_dir(run_copy))] == ["round_000002.ckpt"]


@pytest.mark.parametrize("resume", [[], ["--resume", "auto"]], ids=["resume left at its default", "resume auto"])
def test_overwrite_alone_replaces_the_run_and_starts_from_round_0(run_copy, capsys, resume):
    """Fewer rounds than the run in the folder reached: a resume would refuse them."""
    run_id = load_checkpoint(checkpoint_dir(run_copy) / "last.ckpt")["run_id"]
    main([*BASE, "--federation.rounds", "3", *resume, "--overwrite", "true", "--out_dir", str(run_copy)])
    assert "resuming" not in capsys.readouterr().err
    assert [row["round"] for row in read_metrics(run_copy)] == [1, 2, 3]
    assert [p.name for p in numbered_checkpoints(checkpoint_dir(run_copy))] == ["round_000002.ckpt",
                                                                                 "round_000003.ckpt"]
    assert load_checkpoint(checkpoint_dir(run_copy) / "last.ckpt")["run_id"] != run_id


def test_overwrite_with_a_checkpoint_to_resume_from_is_refused(run_copy, capsys):
    before = folder_snapshot(run_copy)
    stderr = refused(capsys, run_copy, "--resume", str(checkpoint_dir(run_copy) / "last.ckpt"), "--overwrite", "true")
    assert stderr.startswith("error: overwrite: expected false when resume names a checkpoint")
    assert stderr.count("\n") == 1
    assert folder_snapshot(run_copy) == before


def test_explicit_checkpoint_of_another_algorithm_is_refused(run_copy, tmp_path, capsys):
    stderr = refused(capsys, tmp_path / "elsewhere", "--algorithm", "scaffold",
                     "--resume", str(checkpoint_dir(run_copy) / "last.ckpt"))
    assert "algorithm.class_path: 'fl_lightning.algorithms.fedavg.FedAvg' -> " in stderr


def test_a_second_run_on_the_same_folder_refuses_naming_the_first(tmp_path, capsys):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from fl_lightning.run_dir import RunDirLock; "
         f"lock = RunDirLock({str(out_dir)!r}); lock.acquire(); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"  # waits until the lock is taken
        stderr = refused(capsys, out_dir)
        assert f"held by pid {holder.pid} on" in stderr
        assert not (out_dir / "metrics.jsonl").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    fit(out_dir)  # the lock died with its process
    assert [row["round"] for row in read_metrics(out_dir)] == [1, 2, 3, 4]


def test_default_out_dirs_differ_between_experiments_only():
    base = {"algorithm": {"class_path": "X"}, "client_optimizer": {"lr": 0.05},
            "federation": {"rounds": 10, "num_clients": 10}, "logger": {"wandb_mode": "offline"}}
    same_experiment = {**base, "federation": {"rounds": 300, "num_clients": 10}, "logger": {"wandb_mode": "online"}}
    other_lr = {**base, "client_optimizer": {"lr": 0.1}}
    assert default_out_dir(base, "fedavg") == default_out_dir(same_experiment, "fedavg")
    assert default_out_dir(base, "fedavg") != default_out_dir(other_lr, "fedavg")
    assert default_out_dir(base, "fedavg").parent == Path("runs")


def test_final_model_is_returned_for_a_finished_run(run_copy):
    from fl_lightning.cli.arguments import expand_short_names
    from fl_lightning.cli.parser import build_parser
    from fl_lightning.fit import fit as fit_function

    parser = build_parser()
    argv = [*BASE, "--federation.rounds", str(ROUNDS), "--resume", "auto", "--out_dir", str(run_copy)]
    arguments = parser.instantiate_classes(parser.parse_args(expand_short_names(argv))).fit
    arguments.pop("config", None)
    final = fit_function(**arguments)
    saved = load_checkpoint(checkpoint_dir(run_copy) / "last.ckpt")["model"]
    expected = torch.cat([saved[name].reshape(-1) for name in saved if "running" not in name
                          and "num_batches" not in name])
    torch.testing.assert_close(final, expected, rtol=0, atol=0)


def test_explicit_checkpoint_into_a_folder_of_another_experiment_is_refused(run_copy, tmp_path, capsys):
    other = tmp_path / "other"
    fit(other, "--client_optimizer.lr", "0.2")
    stderr = refused(capsys, other, "--resume", str(checkpoint_dir(run_copy) / "last.ckpt"))
    assert "client_optimizer.lr: 0.2 -> 0.05" in stderr and "config.yaml" in stderr
