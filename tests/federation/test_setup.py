"""The clients' samples a run is set up with (`fl_lightning.federation.setup`): written to partition.json as
json.dumps writes them, recorded in a checkpoint by their digests, and checked on resume against the
checkpoint's digests or, in a checkpoint of an earlier version, against the lists it holds."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from quick_runs import ROUNDS, fit, refused

from fl_lightning.checkpoint import (
    DIGEST,
    EARLIER_PARTITION,
    EARLIER_VALIDATION,
    PARTITION_DIGEST,
    VALIDATION_DIGEST,
    checkpoint_dir,
    load_checkpoint,
    numbered_checkpoints,
    save_checkpoint,
)
from fl_lightning.data import ClientSamples, hold_out_validation
from fl_lightning.federation import setup as federation_setup
from fl_lightning.federation.setup import RunData
from fl_lightning.run_dir import VALIDATION_FILE
from fl_lightning.run_logging import read_metrics

MORE_ROUNDS = ("--federation.rounds", str(ROUNDS + 2))


def saved_parts(path: Path) -> list[list[int]]:
    parts = json.loads(path.read_text())
    return [parts[str(client)] for client in range(len(parts))]


def first_sample_moved(split):
    """`split` (a function returning each client's indices) with client 0's last sample given to client 1:
    the same indices one client after the other, only where client 0's end is changed."""
    def moved(*args, **kwargs):
        parts = [np.asarray(part) for part in split(*args, **kwargs)]
        return [parts[0][:-1], np.concatenate([parts[0][-1:], parts[1]]), *parts[2:]]
    return moved


def rewritten_as_an_earlier_version(out_dir: Path) -> None:
    """Every checkpoint of the run saved again as earlier versions saved it: the clients' lists in place of
    the digests."""
    lists = {EARLIER_PARTITION: saved_parts(out_dir / "partition.json")}
    if (out_dir / VALIDATION_FILE).is_file():
        lists[EARLIER_VALIDATION] = saved_parts(out_dir / VALIDATION_FILE)
    numbered = numbered_checkpoints(checkpoint_dir(out_dir))
    for path in numbered:  # oldest first: last.ckpt ends linked to the newest
        state = torch.load(path, map_location="cpu", weights_only=False)
        for key in (DIGEST, PARTITION_DIGEST, VALIDATION_DIGEST):
            del state[key]
        save_checkpoint({**state, **lists}, out_dir, keep=len(numbered))


def test_run_data_given_lists_holds_them_as_client_samples():
    data = RunData(None, None, [np.array([3, 1]), [2]], [[0]])
    assert isinstance(data.partition, ClientSamples) and isinstance(data.validation, ClientSamples)
    assert [part.tolist() for part in data.partition] == [[3, 1], [2]] and data.validation[0].tolist() == [0]
    assert RunData(None, None, data.partition).validation is None


def test_a_checkpoint_holds_the_digest_of_the_clients_samples_and_partition_json_their_lists(run_copy):
    text = (run_copy / "partition.json").read_text()
    assert text == json.dumps(json.loads(text))  # as json.dumps writes it, byte for byte
    state = load_checkpoint(checkpoint_dir(run_copy) / "last.ckpt")
    assert state[PARTITION_DIGEST] == ClientSamples.of(saved_parts(run_copy / "partition.json")).digest()
    assert state[VALIDATION_DIGEST] is None
    assert EARLIER_PARTITION not in state and EARLIER_VALIDATION not in state


@pytest.mark.parametrize("version", ["this", "earlier"])
def test_a_checkpoint_resumes_with_the_same_partition_and_refuses_a_changed_one(run_copy, capsys, monkeypatch,
                                                                               version):
    if version == "earlier":
        rewritten_as_an_earlier_version(run_copy)
        assert EARLIER_PARTITION in load_checkpoint(checkpoint_dir(run_copy) / "last.ckpt")
    monkeypatch.setattr(federation_setup, "partition_indices", first_sample_moved(federation_setup.partition_indices))
    assert "a checkpoint made with the same data, partition and seed" in refused(capsys, run_copy, *MORE_ROUNDS)
    monkeypatch.undo()
    fit(run_copy, *MORE_ROUNDS)
    assert [row["round"] for row in read_metrics(run_copy)] == list(range(1, ROUNDS + 3))
    assert PARTITION_DIGEST in load_checkpoint(checkpoint_dir(run_copy) / "last.ckpt")


def test_held_out_samples_are_checked_against_the_digest_and_against_an_earlier_versions_lists(tmp_path, capsys,
                                                                                             monkeypatch):
    validation = ("--data.validation", "0.25")
    fit(tmp_path, *validation, "--federation.rounds", "2")
    assert load_checkpoint(checkpoint_dir(tmp_path) / "last.ckpt")[VALIDATION_DIGEST] == ClientSamples.of(
        saved_parts(tmp_path / VALIDATION_FILE)).digest()

    def held_out_moved(parts, fraction, seed):
        training, held_out = hold_out_validation(parts, fraction, seed)
        return training, first_sample_moved(lambda: held_out)()

    for version in ("this", "earlier"):
        if version == "earlier":
            rewritten_as_an_earlier_version(tmp_path)
        with monkeypatch.context() as patched:
            patched.setattr(federation_setup, "hold_out_validation", held_out_moved)
            assert "the same validation samples" in refused(capsys, tmp_path, *validation)
    fit(tmp_path, *validation)
    assert [row["round"] for row in read_metrics(tmp_path)] == list(range(1, ROUNDS + 1))


def test_a_checkpoint_with_neither_the_digest_nor_the_lists_of_the_partition_is_refused(run_copy):
    newest = numbered_checkpoints(checkpoint_dir(run_copy))[-1]
    state = torch.load(newest, map_location="cpu", weights_only=False)
    del state[DIGEST], state[PARTITION_DIGEST]
    save_checkpoint(state, run_copy, keep=2)
    with pytest.raises(ValueError, match=rf"checkpoint .*{newest.name} lacks \['{PARTITION_DIGEST}'\]"):
        load_checkpoint(newest)
