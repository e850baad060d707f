"""Client state in bounded memory, end to end: `fl-lightning fit` with every client's state written to disk as
soon as the next client trains (`compute.client_state_memory_mib 0`) gives the model of the run that keeps them
all in memory, bit for bit; so does a run killed (SIGKILL, in a real process) mid-round, mid-write of a client's
state or mid-checkpoint and run again, and checkpoints of the earlier layouts (the states, or every client's
version, in its shards)."""

import shutil
import signal
import sys
from pathlib import Path

import processes
import pytest
import torch
from fault_runs import FIT, RUN_TIMEOUT_S, process_environment
from paths import QUICKSTART

from fl_lightning.checkpoint import (
    CLIENT_INDEX,
    CLIENT_STATES,
    DIGEST,
    checkpoint_dir,
    client_index_path,
    client_shard_path,
    client_state_path,
    content_digest,
    load_checkpoint,
)
from fl_lightning.commands.main import main
from fl_lightning.federation import client_store

ROUNDS = 6
TRAINING = [
    "--config", str(QUICKSTART), "--model.options", "{hidden: 16, depth: 1}", "--logger.progress_bar", "false",
    "--federation.local_steps", "2", "--federation.eval_every", str(ROUNDS), "--checkpoint.every", "2",
    "--checkpoint.keep", "2", "--resume", "auto",
]
ON_DISK = ["--compute.client_state_memory_mib", "0"]


def fit(out_dir: Path, algorithm: str, rounds: int, *extra: str) -> None:
    main(["fit", *TRAINING, "--algorithm", algorithm, "--federation.rounds", str(rounds), "--out_dir", str(out_dir),
          *extra])


def assert_same_run(got: Path, expected: Path) -> None:
    """The same global model and client states, bit for bit."""
    got, expected = (load_checkpoint(checkpoint_dir(path) / "last.ckpt") for path in (got, expected))
    assert got["round"] == expected["round"]
    for name, tensor in expected["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert sorted(got["client_states"]) == sorted(expected["client_states"])
    for client in expected["client_states"]:
        for name, tensor in expected["client_states"][client].items():
            assert torch.equal(got["client_states"][client][name], tensor), (client, name)


@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn", "moon"])
def test_states_on_disk_give_the_model_of_states_in_memory_bit_for_bit(algorithm, tmp_path, monkeypatch):
    writes = []
    save = client_store.save_client_state
    monkeypatch.setattr(client_store, "save_client_state", lambda *args: (writes.append(args[1:3]), save(*args)))
    fit(tmp_path / "memory", algorithm, 4)
    in_memory, writes[:] = list(writes), []
    fit(tmp_path / "disk", algorithm, 4, *ON_DISK)
    assert len(writes) > len(in_memory)  # states written between checkpoints too
    assert_same_run(tmp_path / "disk", tmp_path / "memory")


def as_earlier_layout(out_dir: Path, round_completed: int, shard: dict) -> None:
    """Rewrite a checkpoint as earlier versions wrote it: its client states given by a shard beside it
    (`shard`), no index deltas."""
    path = checkpoint_dir(out_dir) / f"round_{round_completed:06d}.ckpt"
    state = torch.load(path, weights_only=False)
    del state[DIGEST], state[CLIENT_INDEX]
    state["client_state_shards"] = 1
    torch.save({**state, DIGEST: content_digest(state)}, path)
    torch.save({**shard, DIGEST: content_digest(shard)}, client_shard_path(checkpoint_dir(out_dir), round_completed, 0))
    shutil.rmtree(client_index_path(out_dir, round_completed, 0).parent)
    (checkpoint_dir(out_dir) / "last.ckpt").unlink()


def test_a_checkpoint_that_held_the_states_themselves_resumes_bit_for_bit(tmp_path):
    fit(tmp_path / "reference", "scaffold", 4)
    out_dir = tmp_path / "run"
    fit(out_dir, "scaffold", 2)
    saved = load_checkpoint(checkpoint_dir(out_dir) / "round_000002.ckpt")["client_states"]
    as_earlier_layout(out_dir, 2, {"clients": {client: saved[client] for client in saved}})
    shutil.rmtree(out_dir / CLIENT_STATES)
    fit(out_dir, "scaffold", 4)
    assert_same_run(out_dir, tmp_path / "reference")


def test_a_checkpoint_that_listed_every_clients_torch_save_file_resumes_bit_for_bit(tmp_path):
    """The version before index deltas: a shard with every client's version, one torch.save file a state."""
    fit(tmp_path / "reference", "scaffold", 4)
    out_dir = tmp_path / "run"
    fit(out_dir, "scaffold", 2, *ON_DISK)
    saved = load_checkpoint(checkpoint_dir(out_dir) / "round_000002.ckpt")["client_states"]
    for client in saved:
        version = int(saved.versions[client])
        path = client_state_path(out_dir, client, version)
        old = {"client": client, "version": version, "state": saved[client]}
        torch.save({**old, DIGEST: content_digest(old)}, path.with_suffix(".pt"))
        path.unlink()
    as_earlier_layout(out_dir, 2, {"client_versions": saved.versions})
    fit(out_dir, "scaffold", 4)
    assert_same_run(out_dir, tmp_path / "reference")


# Kills a run (its process group) at the nth call of what `point` names:
#   mid-round: a client's state put into the store, a round's clients partly trained;
#   mid-write: a client's state whole in its temporary file, not yet renamed over its file;
#   mid-checkpoint: a checkpoint's main file, after its client-state files and index deltas were written.
KILL_DRIVER = """
import os, signal, sys
from pathlib import Path
from fl_lightning.federation import client_store, loop
point, nth = sys.argv[1], int(sys.argv[2])
calls = [0]

def killing(original, counted=lambda *args: True):
    def wrapped(*args, **kwargs):
        if counted(*args):
            calls[0] += 1
            if calls[0] == nth:
                os.killpg(0, signal.SIGKILL)
        return original(*args, **kwargs)
    return wrapped

if point == "mid-round":
    client_store.ClientStates.put = killing(client_store.ClientStates.put)
elif point == "mid-write":
    os.replace = killing(os.replace, lambda source, target: Path(target).name.startswith("client_"))
else:
    loop.save_checkpoint = killing(loop.save_checkpoint)
sys.argv = ["fl-lightning", *sys.argv[3:]]
from fl_lightning.__main__ import main
main()
"""
# 5 clients a round: the 13th state is round 3's third; the 2nd checkpoint is round 4's.
KILL_POINTS = {"mid-round": 13, "mid-write": 14, "mid-checkpoint": 2}


def run_fit(out_dir: Path, *driver: str) -> int:
    command = [*FIT, *TRAINING, "--algorithm", "scaffold", "--federation.rounds", str(ROUNDS), *ON_DISK,
               "--out_dir", str(out_dir)]
    if driver:  # in its own process group, which the driver kills whole
        command = [sys.executable, "-c", KILL_DRIVER, *driver, *command[len(FIT) - 1:]]
    completed = processes.run(command, env=process_environment(), timeout=RUN_TIMEOUT_S)
    return completed.returncode


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert run_fit(out_dir) == 0
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_run_killed_and_run_again_reaches_the_uninterrupted_model_bit_for_bit(point, uninterrupted, tmp_path):
    out_dir = tmp_path / "run"
    assert run_fit(out_dir, point, str(KILL_POINTS[point])) == -signal.SIGKILL
    if point == "mid-write":
        assert [path for path in (out_dir / CLIENT_STATES).rglob(".client_*.tmp")], "killed before a rename"
    assert run_fit(out_dir) == 0
    assert not list((out_dir / CLIENT_STATES).rglob(".*.tmp"))
    assert_same_run(out_dir, uninterrupted)
