"""The per-client state of stateful algorithms (fl_lightning.federation.client_store): a copy per client
on the host, in memory while it fits the bound, past it in one file per client and version, each written
atomically and checked by its digest; checkpoints that write only the states changed since the previous one
and refer to the others' files, and the files a kept checkpoint refers to kept while the older go."""

import os

import numpy as np
import pytest
import torch

from fl_lightning import atomic_files
from fl_lightning.checkpoint import (
    NOT_SAVED,
    ClientStateFiles,
    client_index_path,
    client_state_path,
    content_digest,
    load_client_index,
    load_client_state,
)
from fl_lightning.errors import WriteFailed
from fl_lightning.federation import client_store
from fl_lightning.federation.client_store import ClientStates

CPU = torch.device("cpu")
STATE_BYTES = 256 * 4  # of `state_of`


def state_of(client: int, round_completed: int) -> dict[str, torch.Tensor]:
    """A state that says whose it is and when it was trained."""
    return {"control": torch.full((256,), client + round_completed / 1000.0)}


def trained(states: ClientStates, round_completed: int, clients: list[int]) -> None:
    states.round_completed = round_completed
    for client in clients:
        states.put(client, state_of(client, round_completed))


def files_of(out_dir) -> set[str]:
    """The state files (the index deltas apart)."""
    return {path.name for path in (out_dir / "client_states").glob("[0-9]*/*") if path.is_file()}


def index_of(out_dir, states: ClientStates) -> list[int]:
    """Every client's version in the index of the store's last checkpoint, read back from its deltas."""
    return load_client_index(out_dir, states.index_deltas).tolist()


def bounded(out_dir, clients_in_memory: int) -> ClientStates:
    return ClientStates.resumed(out_dir, clients_in_memory * STATE_BYTES, 0, {}, rank=0, world_size=1)


# In memory


def test_a_stored_state_is_a_detached_copy_on_the_host():
    states = ClientStates()
    weight = torch.ones(3, requires_grad=True)
    working = weight * 2
    states.put(4, {"control": working})
    with torch.no_grad():
        working.add_(1.0)  # the round's tensor is reused: the stored state must not follow it
    stored = states.by_client[4]["control"]
    assert stored.tolist() == [2.0, 2.0, 2.0]
    assert not stored.requires_grad and stored.grad_fn is None
    assert stored.device.type == "cpu"


def test_a_new_state_replaces_the_clients_previous_one_whole():
    states = ClientStates()
    states.put(1, {"control": torch.zeros(2), "previous_model": torch.ones(2)})
    states.put(1, {"control": torch.full((2,), 5.0)})
    got = states.get(1, CPU)
    assert list(got) == ["control"]
    assert got["control"].tolist() == [5.0, 5.0]


def test_clients_keep_states_of_their_own():
    states = ClientStates()
    for client in (0, 9, 3):
        states.put(client, {"control": torch.full((2,), float(client)), "h": torch.tensor([client * 10.0])})
    assert sorted(states.by_client) == [0, 3, 9]
    for client in (0, 9, 3):
        got = states.get(client, CPU)
        assert got["control"].tolist() == [float(client)] * 2 and got["h"].tolist() == [client * 10.0]


def test_a_client_that_never_trained_has_an_empty_state():
    states = ClientStates({2: {"control": torch.zeros(1)}})
    assert states.get(7, CPU) == {}
    assert 7 not in states.by_client  # asking does not create an entry


def test_initial_states_are_stored_as_put_would_store_them():
    restored = {3: {"control": torch.arange(4.0)}, 8: {"control": torch.ones(4, dtype=torch.float64)}}
    states = ClientStates(restored)
    restored[3]["control"].zero_()  # what a checkpoint gave is the caller's: a copy is kept
    assert states.get(3, CPU)["control"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert states.get(8, CPU)["control"].dtype == torch.float64




# Bounded memory


def test_states_past_the_bound_go_to_disk_and_come_back_bit_for_bit(tmp_path):
    states = bounded(tmp_path, clients_in_memory=2)
    trained(states, 1, [5, 1, 8, 3])
    assert list(states.by_client) == [8, 3]  # the most recently trained
    assert files_of(tmp_path) == {"client_0000005.r000001.safetensors", "client_0000001.r000001.safetensors"}
    for client in (5, 1, 8, 3):
        assert torch.equal(states.get(client, CPU)["control"], state_of(client, 1)["control"])
    assert states.get(7, CPU) == {}


def test_within_the_bound_nothing_is_written_until_a_checkpoint(tmp_path):
    states = bounded(tmp_path, clients_in_memory=4)
    trained(states, 1, [0, 1, 2, 3])
    trained(states, 2, [0, 1])
    assert not (tmp_path / "client_states").exists()
    states.checkpoint(2, 1)
    assert index_of(tmp_path, states) == [2, 2, 1, 1]
    assert files_of(tmp_path) == {"client_0000000.r000002.safetensors", "client_0000001.r000002.safetensors",
                                  "client_0000002.r000001.safetensors", "client_0000003.r000001.safetensors"}


def test_a_checkpoint_writes_only_the_states_changed_since_the_previous_one(tmp_path, monkeypatch):
    states = bounded(tmp_path, clients_in_memory=100)
    trained(states, 1, list(range(10)))
    states.checkpoint(1, 1)
    written = []
    write = atomic_files.write_atomically
    monkeypatch.setattr(atomic_files, "write_atomically",
                        lambda target, *a, **k: (written.append(os.path.basename(target)), write(target, *a, **k)))
    trained(states, 2, [4, 7])
    states.checkpoint(2, 1)
    assert sorted(written) == ["client_0000004.r000002.safetensors", "client_0000007.r000002.safetensors",
                               "round_000002.rank0.pt"]
    assert index_of(tmp_path, states) == [1, 1, 1, 1, 2, 1, 1, 2, 1, 1]


def test_state_files_are_synced_to_disk_once_by_the_checkpoint_that_refers_to_them(tmp_path, monkeypatch):
    """A flush a file would cost a round of many clients more than its training; a kill leaves each file
    whole without it, and a crash of the machine loses nothing a checkpoint refers to."""
    flushed, syncs = [], []
    monkeypatch.setattr(os, "fsync", lambda descriptor: flushed.append(os.readlink(f"/proc/self/fd/{descriptor}")))
    monkeypatch.setattr(os, "sync", lambda: syncs.append("sync"))
    states = bounded(tmp_path, clients_in_memory=1)
    trained(states, 1, [0, 1, 2])
    assert len(files_of(tmp_path)) == 2 and flushed == [] and syncs == []
    states.checkpoint(1, 1)
    # Only the index delta, which the checkpoint's main file refers to, is flushed on its own.
    assert len(files_of(tmp_path)) == 3 and syncs == ["sync"]
    assert [os.path.basename(path).split(".tmp")[0] for path in flushed] == [".round_000001.rank0.pt.%d" % os.getpid()]
    states.checkpoint(1, 1)  # nothing written since
    assert syncs == ["sync"]


def test_a_file_goes_once_no_kept_checkpoint_refers_to_it(tmp_path):
    states = bounded(tmp_path, clients_in_memory=100)
    trained(states, 1, [0, 1])
    states.checkpoint(1, 1)
    trained(states, 2, [0])
    states.checkpoint(2, 1)
    states.pruned([1, 2])  # the checkpoint of round 1 still refers to client 0's state after round 1
    assert files_of(tmp_path) == {"client_0000000.r000001.safetensors", "client_0000000.r000002.safetensors",
                                  "client_0000001.r000001.safetensors"}
    trained(states, 3, [1])
    states.checkpoint(3, 1)
    states.pruned([2, 3])
    assert files_of(tmp_path) == {"client_0000000.r000002.safetensors", "client_0000001.r000001.safetensors",
                                  "client_0000001.r000003.safetensors"}


def test_a_state_spilled_between_checkpoints_and_replaced_before_the_next_is_removed_at_once(tmp_path):
    states = bounded(tmp_path, clients_in_memory=1)
    trained(states, 1, [0, 1])  # client 0's state after round 1 goes to disk
    trained(states, 2, [0, 1])  # and is replaced: no checkpoint ever referred to it
    assert files_of(tmp_path) == {"client_0000001.r000001.safetensors", "client_0000000.r000002.safetensors"}


@pytest.mark.parametrize("damage", ["truncated", "flipped", "removed"])
def test_a_damaged_state_file_is_refused_naming_the_client_and_the_file(tmp_path, damage):
    states = bounded(tmp_path, clients_in_memory=1)
    trained(states, 1, [3, 4])
    path = client_state_path(tmp_path, 3, 1)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        path.write_bytes(bytes(data[:len(data) // 2]))
    elif damage == "flipped":
        # The tensors' bytes end the file: a reader of the format loads flipped ones without complaint.
        data[-8:] = bytes(255 - b for b in data[-8:])
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    problem = {"truncated": "is unreadable", "flipped": "fails its sha256 check", "removed": "is missing"}[damage]
    with pytest.raises(ValueError, match=f"the state of client 3, {path} {problem}"):
        states.get(3, CPU)


def test_a_state_file_of_another_client_is_refused(tmp_path):
    states = bounded(tmp_path, clients_in_memory=1)
    trained(states, 1, [3, 4])
    os.replace(client_state_path(tmp_path, 3, 1), client_state_path(tmp_path, 5, 1))
    files = ClientStateFiles(tmp_path, np.array([NOT_SAVED] * 5 + [1], dtype=np.int32))
    with pytest.raises(ValueError, match=f"the state of client 5, {client_state_path(tmp_path, 5, 1)}, holds client 3"):
        files[5]


def test_a_state_file_of_an_earlier_version_is_read_where_the_new_one_is_absent(tmp_path):
    """Runs of earlier versions wrote torch.save files; a resume reads them, checked as before."""
    earlier = client_state_path(tmp_path, 7, 2).with_suffix(".pt")
    earlier.parent.mkdir(parents=True)
    state = state_of(7, 2)
    torch.save({"client": 7, "version": 2, "state": state,
                "sha256": content_digest({"client": 7, "version": 2, "state": state})}, earlier)
    assert torch.equal(load_client_state(tmp_path, 7, 2)["control"], state["control"])
    with pytest.raises(ValueError, match=f"the state of client 8, {client_state_path(tmp_path, 8, 2)} is missing"):
        load_client_state(tmp_path, 8, 2)


def test_a_write_that_fails_leaves_the_clients_previous_file_whole_and_no_temporary_file(tmp_path, monkeypatch):
    states = bounded(tmp_path, clients_in_memory=100)
    trained(states, 1, [2])
    states.checkpoint(1, 1)
    before = client_state_path(tmp_path, 2, 1).read_bytes()
    trained(states, 2, [2])
    write = atomic_files.write_atomically

    def torn_write(target, content, synced=True):
        def half(file):
            file.write(b"half a state")
            raise OSError(28, "No space left on device")
        write(target, half, synced)

    monkeypatch.setattr(atomic_files, "write_atomically", torn_write)
    with pytest.raises(WriteFailed, match=f"cannot write {client_state_path(tmp_path, 2, 2)}"):
        states.checkpoint(2, 1)
    assert files_of(tmp_path) == {"client_0000002.r000001.safetensors"}
    assert client_state_path(tmp_path, 2, 1).read_bytes() == before


# The index of a checkpoint


def test_a_checkpoints_index_delta_holds_only_the_clients_changed_since_the_previous_one(tmp_path):
    """So what a checkpoint writes does not grow with the clients of the federation."""
    states = bounded(tmp_path, clients_in_memory=10_000)
    trained(states, 1, list(range(1000)))
    states.checkpoint(1, 1)
    trained(states, 2, [4, 999])
    states.checkpoint(2, 1)
    delta = torch.load(client_index_path(tmp_path, 2, 0), weights_only=False)
    assert delta["clients"].tolist() == [4, 999] and delta["versions"].tolist() == [2, 2]
    assert states.index_deltas == [(1, 1), (2, 1)]
    assert index_of(tmp_path, states) == [1] * 4 + [2] + [1] * 994 + [2]


def test_a_second_checkpoint_of_the_same_round_keeps_what_the_first_indexed(tmp_path):
    states = bounded(tmp_path, clients_in_memory=100)
    trained(states, 1, [0, 1])
    states.checkpoint(1, 1)
    trained(states, 2, [1])
    states.checkpoint(2, 1)
    states.checkpoint(2, 1)
    assert states.index_deltas == [(1, 1), (2, 1)]
    assert index_of(tmp_path, states) == [1, 2]


@pytest.mark.parametrize("damage", ["flipped", "removed"])
def test_a_damaged_or_missing_index_delta_is_refused_naming_it(tmp_path, damage):
    states = bounded(tmp_path, clients_in_memory=100)
    trained(states, 1, [0, 1])
    states.checkpoint(1, 1)
    trained(states, 2, [1])
    states.checkpoint(2, 1)
    path = client_index_path(tmp_path, 1, 0)
    if damage == "removed":
        path.unlink()
    else:
        torch.save({**torch.load(path, weights_only=False), "versions": np.array([1, 3], dtype=np.int32)}, path)
    problem = {"flipped": "fails its sha256 check", "removed": "is missing"}[damage]
    with pytest.raises(ValueError, match=f"client-state index {path} {problem}"):
        load_client_index(tmp_path, states.index_deltas)


def test_a_resume_keeps_the_files_its_checkpoint_refers_to_and_removes_those_written_after_it(tmp_path):
    states = bounded(tmp_path, clients_in_memory=100)
    trained(states, 1, [0, 1, 2])
    states.checkpoint(1, 1)
    trained(states, 2, [0])
    states.checkpoint(2, 1)
    deltas = list(states.index_deltas)
    trained(states, 3, [0, 1])
    states.checkpoint(3, 1)  # a checkpoint whose main file a kill kept from being written
    temporary = client_state_path(tmp_path, 2, 3).with_name(".client_0000002.r000003.safetensors.4242.tmp")
    temporary.write_bytes(b"a write a kill cut short")

    saved = ClientStateFiles(tmp_path, load_client_index(tmp_path, deltas))
    resumed = ClientStates.resumed(tmp_path, 100 * STATE_BYTES, 2, saved, 0, 1, deltas)
    assert files_of(tmp_path) == {"client_0000000.r000001.safetensors", "client_0000000.r000002.safetensors",
                                  "client_0000001.r000001.safetensors", "client_0000002.r000001.safetensors"}
    assert not client_index_path(tmp_path, 3, 0).exists()
    assert torch.equal(resumed.get(0, CPU)["control"], state_of(0, 2)["control"])
    assert torch.equal(resumed.get(1, CPU)["control"], state_of(1, 1)["control"])
    resumed.round_completed = 3
    resumed.put(0, state_of(0, 3))
    resumed.checkpoint(4, 1)
    assert resumed.index_deltas == [(1, 1), (2, 1), (4, 1)]
    assert index_of(tmp_path, resumed) == [3, 1, 1]
    resumed.pruned([2, 4])  # the round-1 file of client 0 that the round-2 checkpoint replaced goes
    assert "client_0000000.r000001.safetensors" not in files_of(tmp_path)


def test_a_rank_keeps_and_sweeps_only_the_clients_it_owns(tmp_path):
    states = bounded(tmp_path, clients_in_memory=100)
    trained(states, 1, [0, 1, 2, 3])
    states.checkpoint(1, 1)
    deltas = list(states.index_deltas)
    trained(states, 2, [0, 1])
    states.checkpoint(2, 1)
    saved = ClientStateFiles(tmp_path, load_client_index(tmp_path, deltas))
    odd = ClientStates.resumed(tmp_path, 0, 1, saved, rank=1, world_size=2, index_deltas=deltas)
    assert files_of(tmp_path) == {"client_0000000.r000002.safetensors",
                                  *(f"client_{c:07d}.r000001.safetensors" for c in range(4))}
    odd.round_completed = 2
    odd.put(3, state_of(3, 2))
    odd.checkpoint(2, 2)
    assert torch.load(client_index_path(tmp_path, 2, 1), weights_only=False)["clients"].tolist() == [3]
    assert load_client_index(tmp_path, [(1, 1)]).tolist() == [1, 1, 1, 1]


def test_a_checkpoint_of_an_earlier_version_resumes_with_its_states_in_memory(tmp_path):
    saved = {0: state_of(0, 1), 1: state_of(1, 1)}
    resumed = ClientStates.resumed(tmp_path, 100 * STATE_BYTES, 1, saved, rank=0, world_size=1)
    assert torch.equal(resumed.get(1, CPU)["control"], state_of(1, 1)["control"])
    resumed.checkpoint(1, 1)  # written at the next checkpoint, in today's layout
    assert index_of(tmp_path, resumed) == [1, 1]
    assert files_of(tmp_path) == {"client_0000000.r000001.safetensors", "client_0000001.r000001.safetensors"}


def test_a_checkpoint_that_listed_every_clients_version_is_followed_by_a_whole_index(tmp_path):
    """The checkpoints of the version before index deltas held each client's version: the first
    checkpoint after resuming from one indexes every client, not only those that changed."""
    states = bounded(tmp_path, clients_in_memory=100)
    trained(states, 1, [0, 1, 2])
    states.checkpoint(1, 1)
    saved = ClientStateFiles(tmp_path, load_client_index(tmp_path, states.index_deltas))
    resumed = ClientStates.resumed(tmp_path, 100 * STATE_BYTES, 1, saved, 0, 1, index_deltas=None)
    resumed.round_completed = 2
    resumed.put(1, state_of(1, 2))
    resumed.checkpoint(2, 1)
    assert resumed.index_deltas == [(2, 1)]
    assert index_of(tmp_path, resumed) == [1, 2, 1]


# Reading ahead


def test_the_states_of_the_clients_about_to_train_are_read_ahead_in_the_background(tmp_path, monkeypatch):
    states = bounded(tmp_path, clients_in_memory=8)
    trained(states, 1, list(range(12)))  # 0 to 3 on disk
    read = []
    monkeypatch.setattr(client_store, "load_client_state",
                        lambda out_dir, client, version: read.append(client) or load_client_state(out_dir, client,
                                                                                                   version))
    states.read_ahead([2, 11, 0, 50])  # 11 is in memory, 50 never trained; a window of 2 (a quarter of 8)
    for future in [ahead for _, ahead in states._ahead.values()]:
        future.result()  # the readings end in the background
    assert sorted(read) == [0, 2]
    for client in (2, 11, 0):
        assert torch.equal(states.get(client, CPU)["control"], state_of(client, 1)["control"])
    assert sorted(read) == [0, 2]  # none read twice


def test_a_state_read_ahead_and_then_replaced_is_read_again(tmp_path):
    states = bounded(tmp_path, clients_in_memory=1)
    trained(states, 1, [0, 1])
    states.read_ahead([0])
    trained(states, 2, [0, 1])  # client 0's file after round 1 is replaced while it was read ahead
    assert torch.equal(states.get(0, CPU)["control"], state_of(0, 2)["control"])


def test_a_damaged_file_read_ahead_is_refused_when_its_client_trains(tmp_path):
    states = bounded(tmp_path, clients_in_memory=1)
    trained(states, 1, [3, 4])
    path = client_state_path(tmp_path, 3, 1)
    path.write_bytes(path.read_bytes()[:20])
    states.read_ahead([3])
    with pytest.raises(ValueError, match=f"the state of client 3, {path} is unreadable"):
        states.get(3, CPU)


def test_read_ahead_holds_at_most_a_quarter_of_the_bound(tmp_path):
    states = bounded(tmp_path, clients_in_memory=8)
    trained(states, 1, list(range(20)))
    states.read_ahead(range(12))
    assert len(states._ahead) == 2  # a quarter of 8 states
    states.get(0, CPU)
    assert sorted(states._ahead) == [1, 2]


def test_a_resumed_store_reads_one_state_ahead_until_it_knows_a_states_size(tmp_path):
    """States of a large model read ahead by the window of small ones would take many times the bound."""
    states = bounded(tmp_path, clients_in_memory=100)
    trained(states, 1, list(range(10)))
    states.checkpoint(1, 1)
    saved = ClientStateFiles(tmp_path, load_client_index(tmp_path, states.index_deltas))
    resumed = ClientStates.resumed(tmp_path, 100 * STATE_BYTES, 1, saved, 0, 1, states.index_deltas)
    resumed.read_ahead(range(10))
    assert list(resumed._ahead) == [0]
    resumed.get(0, CPU)
    assert len(resumed._ahead) == 10 - 1  # a quarter of 100 states' worth, the 9 left
