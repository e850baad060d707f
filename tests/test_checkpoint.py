"""Checkpoints: last.ckpt verified and rewritten from the newest good checkpoint, a corrupted tensor, client-
state index delta or client-state file caught by its digest and the previous checkpoint used, garbage given to
resume refused in one line, and temporary files left by a kill removed."""

import os
import random
import shutil
from pathlib import Path

import pytest
from quick_runs import ROUNDS, fit, refused

from fl_lightning.checkpoint import checkpoint_dir, client_index_path, load_checkpoint, numbered_checkpoints
from fl_lightning.run_logging import read_metrics


def test_last_ckpt_alone_is_found_when_the_numbered_checkpoints_are_gone(run_copy, capsys):
    for path in numbered_checkpoints(checkpoint_dir(run_copy)):
        path.unlink()
    fit(run_copy)
    assert "nothing to train" in capsys.readouterr().err
    assert [row["round"] for row in read_metrics(run_copy)] == [1, 2, 3, 4]


def test_a_garbage_last_ckpt_of_a_finished_run_is_rewritten_from_the_newest_good_checkpoint(run_copy, capsys):
    folder = checkpoint_dir(run_copy)
    newest = numbered_checkpoints(folder)[-1]
    (folder / "last.ckpt").unlink()  # replaced, not written through: a hard link would take the newest with it
    (folder / "last.ckpt").write_bytes(random.Random(0).randbytes(4096))
    # (?s): torch.load's message of what it could not read may span lines.
    with pytest.warns(UserWarning, match=rf"(?s)checkpoint {folder / 'last.ckpt'} is unreadable .*; rewritten from "
                      rf"{newest} \(round {ROUNDS}\)"):
        fit(run_copy)
    assert "nothing to train" in capsys.readouterr().err
    last = load_checkpoint(folder / "last.ckpt")
    assert last["round"] == ROUNDS and os.path.samefile(folder / "last.ckpt", newest)


def test_a_last_ckpt_behind_the_newest_checkpoint_is_rewritten(run_copy):
    """A kill between a checkpoint's save and the link of last.ckpt to it, at the last round."""
    folder = checkpoint_dir(run_copy)
    *_, previous, newest = numbered_checkpoints(folder)
    shutil.copyfile(previous, folder / "last.ckpt")
    with pytest.warns(UserWarning, match=f"holds round {ROUNDS - 2}, behind the newest good checkpoint"):
        fit(run_copy)
    assert os.path.samefile(folder / "last.ckpt", newest)


def test_garbage_resume_file_is_one_error_line(tmp_path, capsys):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(os.urandom(256))
    stderr = refused(capsys, tmp_path / "run", "--resume", str(garbage))
    assert stderr.startswith("error: resume:") and "Traceback" not in stderr


def flip_bytes_inside(path: Path, marker: bytes) -> None:
    """Overwrite 8 bytes just after `marker` (inside a stored tensor's data)."""
    data = bytearray(path.read_bytes())
    at = data.index(marker) + 64
    data[at:at + 8] = bytes(255 - b for b in data[at:at + 8])
    path.write_bytes(bytes(data))


def test_a_corrupted_tensor_byte_is_caught_and_the_previous_checkpoint_used(run_copy, capsys):
    *_, previous, newest = numbered_checkpoints(checkpoint_dir(run_copy))
    (checkpoint_dir(run_copy) / "last.ckpt").unlink()
    flip_bytes_inside(newest, b"data/0")
    with pytest.raises(ValueError, match="fails its sha256 check"):
        load_checkpoint(newest)
    with pytest.warns(UserWarning, match="trying the previous checkpoint"):
        fit(run_copy)
    assert f"resuming from {previous}" in capsys.readouterr().err
    assert [row["round"] for row in read_metrics(run_copy)] == [1, 2, 3, 4]


def test_last_ckpt_damaged_in_place_is_its_newest_round_damaged_too_and_the_previous_one_is_used(run_copy, capsys):
    """last.ckpt is a hard link of the newest numbered checkpoint (docs/reliability.md): bytes changed
    in the file change both names, and the resume falls back to the checkpoint before them."""
    folder = checkpoint_dir(run_copy)
    *_, previous, newest = numbered_checkpoints(folder)
    (folder / "last.ckpt").unlink()  # the run's copy holds two files: linked again, as fit leaves them
    os.link(newest, folder / "last.ckpt")
    flip_bytes_inside(folder / "last.ckpt", b"data/0")
    with pytest.raises(ValueError, match="fails its sha256 check"):
        load_checkpoint(newest)
    with pytest.warns(UserWarning, match="trying the previous checkpoint"):
        fit(run_copy)
    assert f"resuming from {previous}" in capsys.readouterr().err
    assert load_checkpoint(folder / "last.ckpt")["round"] == ROUNDS and os.path.samefile(folder / "last.ckpt", newest)


def test_a_truncated_client_state_index_delta_is_caught(tmp_path):
    out_dir = tmp_path / "run"
    fit(out_dir, "--algorithm", "scaffold")
    delta = client_index_path(out_dir, 2, 0)  # which the checkpoint of round 4 is made of too
    delta.write_bytes(delta.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"client-state index {delta} is unreadable"):
        load_checkpoint(checkpoint_dir(out_dir) / "round_000004.ckpt")


def test_a_damaged_client_state_file_is_named_and_the_previous_checkpoint_used(tmp_path, capsys):
    out_dir = tmp_path / "run"
    fit(out_dir, "--algorithm", "scaffold")
    newest, previous = (checkpoint_dir(out_dir) / f"round_{r:06d}.ckpt" for r in (ROUNDS, ROUNDS - 2))
    damaged = sorted((out_dir / "client_states").rglob(f"client_*.r{ROUNDS:06d}.safetensors"))[0]
    client = int(damaged.name.split(".")[0].removeprefix("client_"))
    data = bytearray(damaged.read_bytes())
    data[-8:] = bytes(255 - b for b in data[-8:])  # inside the last tensor's bytes
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"checkpoint {newest}: the state of client {client}, {damaged} fails its "
                                         "sha256 check"):
        load_checkpoint(newest)
    (checkpoint_dir(out_dir) / "last.ckpt").unlink()
    with pytest.warns(UserWarning, match=f"the state of client {client}, {damaged} fails its sha256 check: .*; "
                                         "trying the previous checkpoint"):
        fit(out_dir, "--algorithm", "scaffold")
    assert f"resuming from {previous}" in capsys.readouterr().err
    assert load_checkpoint(newest)["round"] == ROUNDS  # trained again, its client states written anew


def test_leftover_temporary_files_are_removed(run_copy):
    leftover = checkpoint_dir(run_copy) / ".round_000006.ckpt.12345.tmp"
    leftover.write_bytes(b"half a checkpoint")
    fit(run_copy)
    assert not leftover.exists()


def test_the_servers_state_is_saved_in_the_layout_of_the_checkpoints_runs_resume_from(tmp_path):
    """A checkpoint's `algorithm` entry holds the algorithm's server tensors and the server optimizer's
    state under the names every checkpoint has had, so that runs saved before resume as they did."""
    fit(tmp_path, "--algorithm", "scaffold", "--server_optimizer", "fl_lightning.server_optimizers.FedAdam")
    saved = load_checkpoint(checkpoint_dir(tmp_path) / "last.ckpt")["algorithm"]
    assert {entry: set(tensors) for entry, tensors in saved.items()} == {
        "server_state": {"control"}, "server_optimizer": {"first_moment", "second_moment"}}
