"""Two nodes, for real: `fl-lightning fit` started once per node, as a per-node launcher or srun
starts it (NODE_RANK, MASTER_ADDR, MASTER_PORT; one rank each), over gloo on this machine.

The two nodes share out_dir, as nodes share a cluster's file system. They must train the model of
one rank (up to float rounding: two ranks sum the clients' uploads in another order), global rank
0 alone must write the run's files and each checkpoint, and that checkpoint must resume on one node
to the model of an uninterrupted one-node run.
"""

import os
import re
import sys
from pathlib import Path

import processes
import pytest
import torch
from fault_runs import wait_all
from paths import QUICKSTART

from fl_lightning.checkpoint import checkpoint_dir
from fl_lightning.cluster import check_slurm_allocation
from fl_lightning.commands.main import main
from fl_lightning.config import FabricArgs
from fl_lightning.errors import ConfigError

# SCAFFOLD keeps per-client state, so each rank also writes its own index delta of every checkpoint and the
# one-node resume has to merge the deltas of two ranks.
TRAINING = [
    "--config", QUICKSTART, "--algorithm", "scaffold", "--model.options", "{hidden: 16, depth: 1}",
    "--federation.clients_per_round", "4", "--federation.local_steps", "3", "--federation.eval_every", "1",
    "--checkpoint.every", "1", "--checkpoint.keep", "5", "--logger.progress_bar", "false", "--resume", "auto",
]
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                    "MASTER_ADDR", "MASTER_PORT")
# `fl-lightning fit` with every atomic write of a file (checkpoints, shards, config.yaml, metrics.jsonl)
# appended to <argv[1]>/writes_node<NODE_RANK>.txt, one file per process.
RECORDING_DRIVER = """
import os, sys
from pathlib import Path
from fl_lightning import atomic_files
record = Path(sys.argv[1]) / f"writes_node{os.environ['NODE_RANK']}.txt"
original = atomic_files.replace_atomically

def recorded(write, target):
    original(write, target)
    with open(record, "a") as f:
        f.write(Path(target).name + "\\n")

atomic_files.replace_atomically = recorded
sys.argv = ["fl-lightning", *sys.argv[2:]]
from fl_lightning.__main__ import main
main()
"""


@pytest.fixture(autouse=True)
def outside_any_launch(monkeypatch):
    """The one-node runs in this process must not see a launcher's or SLURM's variables."""
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in LAUNCH_VARIABLES:
            monkeypatch.delenv(name)


def start_nodes(out_dir: Path, logs: Path, *extra: str) -> list[processes.Popen]:
    """Each node's process forked (tests/support/processes.py)."""
    logs.mkdir(parents=True)
    port = str(processes.free_port())
    nodes = []
    for node_rank in range(2):
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "NODE_RANK": str(node_rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        command = [sys.executable, "-c", RECORDING_DRIVER, str(logs), "fit", *TRAINING, *extra,
                   "--fabric.accelerator", "cpu", "--fabric.num_nodes", "2", "--fabric.devices", "1",
                   "--fabric.process_group_timeout_s", "60", "--out_dir", str(out_dir)]
        with open(logs / f"node{node_rank}.out", "w") as stdout, open(logs / f"node{node_rank}.err", "w") as stderr:
            nodes.append(processes.Popen(command, env=environment, stdout=stdout, stderr=stderr))
    return nodes


def node_logs(logs: Path) -> str:
    return "\n".join(f"--- {path.name}\n{path.read_text()}" for path in sorted(logs.glob("node*.*")))


def model_at(out_dir: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint_dir(out_dir) / name, map_location="cpu", weights_only=False)["model"]


def assert_close_models(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=f"{name} differs")


@pytest.mark.multiprocess
def test_two_nodes_train_the_model_of_one_rank_and_their_checkpoint_resumes_on_one_node(tmp_path):
    out_dir, logs = tmp_path / "two_nodes", tmp_path / "logs"
    nodes = start_nodes(out_dir, logs, "--federation.rounds", "2")
    assert wait_all(nodes) == [0, 0], node_logs(logs)
    rows = (out_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2, "metrics.jsonl must hold each round once, written by global rank 0 alone"

    writes = {node: (logs / f"writes_node{node}.txt").read_text().splitlines() for node in range(2)}
    checkpoints = [name for name in writes[0] if name.endswith(".ckpt")]
    assert checkpoints == ["round_000001.ckpt", "last.ckpt", "round_000002.ckpt", "last.ckpt"]
    assert {"config.yaml", "partition.json"} <= set(writes[0])
    # Global rank 1 writes its own client-state index delta of each checkpoint and its own clients' (odd ids)
    # states, and nothing else.
    assert writes[1] and all(re.fullmatch(r"round_\d+\.rank1\.pt", name)
                             or re.fullmatch(r"client_\d*[13579]\.r\d+\.safetensors", name)
                             for name in writes[1]), writes[1]

    one_node = tmp_path / "one_node"
    main(["fit", *TRAINING, "--federation.rounds", "3", "--out_dir", str(one_node)])
    assert_close_models(model_at(out_dir, "last.ckpt"), model_at(one_node, "round_000002.ckpt"))

    main(["fit", *TRAINING, "--federation.rounds", "3", "--out_dir", str(out_dir)])
    assert len((out_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert_close_models(model_at(out_dir, "last.ckpt"), model_at(one_node, "last.ckpt"))


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT", "NODE_RANK"])
def test_a_node_started_without_one_rendezvous_variable_is_refused(missing, monkeypatch):
    """Without MASTER_PORT Lightning would pick a free port on each node, and the nodes would wait on
    different ports until the process group timed out."""
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "1"}.items():
        if name != missing:
            monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as raised:
        check_slurm_allocation(FabricArgs(devices=1, num_nodes=2))
    assert raised.value.field_name == "fabric.num_nodes"


def test_nodes_started_by_torchrun_pass_the_check(monkeypatch):
    """torchrun sets MASTER_ADDR and MASTER_PORT, and the node's rank as GROUP_RANK (no NODE_RANK)."""
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_RANK": "1", "RANK": "1",
                        "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    check_slurm_allocation(FabricArgs(devices=1, num_nodes=2))
