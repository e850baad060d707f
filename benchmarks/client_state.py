"""Client state in bounded memory: peak resident memory, seconds per round and bytes written per checkpoint of
SCAFFOLD and MOON with a small MLP (one hidden layer of 16) at N clients, S = N / rounds drawn each round (by the
end of 20 rounds about 64% of the clients have trained, 1 - (1 - 1/20)^20), with the clients' states all in
memory (the store off: `compute.client_state_memory_mib` far above what they take) and in bounded memory (the
store on: `--bound-mib`), side by side in one run; `--stores unread` adds the store on without reading the states of
the clients about to train ahead of them, the reference of what reading ahead saves.

Every configuration runs in a process of its own, as `fit` runs a rank (a `FederatedLoop` on one CPU rank of one
thread, its checkpoints written to a temporary run folder), since peak resident memory is a process's. The data
does not grow with N: a fixed pool of 20,000 random 8x8 one-channel training images (and 100 test ones), of
which client i holds samples 2i and 2i + 1 modulo 20,000, given as `ClientSamples` (two arrays, not a list of an
array a client); each client trains one step of batch 2 a round. Reported per
configuration: the process's resident memory once the run is set up (data, partition, model: what does not
depend on the store) and its peak by the end; the mean seconds per round (`run_round`, checkpoints apart); the
mean bytes a checkpoint writes (every file it writes, the client-state files included), beside what a checkpoint
of the earlier layout, every client's state in the shard, would have written at the last checkpoint (a state
file's size times the clients that trained); and the
bytes the store wrote between checkpoints (states past the bound).

    python benchmarks/client_state.py
    python benchmarks/client_state.py --clients 1000 10000 100000 --algorithms scaffold
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_images  # noqa: E402

ALGORITHMS = ("scaffold", "moon")
STORE_OFF_MIB = 2**20  # a TiB: every state stays in memory
SEED = 0
POOL = 20_000  # training images, shared by the clients at every N


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1000, 10000, 100000],
                        help="N, the federation's clients, one configuration each (default: 1000 10000 100000)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated (default: scaffold,moon)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds (default: 20)")
    parser.add_argument("--clients-per-round", type=int, default=None,
                        help="S, the same at every N (default: N / rounds, every client trained once by the end)")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="rounds between checkpoints (default: 5)")
    parser.add_argument("--bound-mib", type=int, default=16,
                        help="compute.client_state_memory_mib of the store on (default: 16)")
    parser.add_argument("--stores", default="off,on", help="comma-separated, of off (every state in memory), on "
                        "(the bound of --bound-mib) and unread (on, without reading states ahead) (default: off,on)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    parser.add_argument("--one", nargs=3, metavar=("ALGORITHM", "N", "STORE"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class WrittenBytes:
    """Bytes of every file written atomically (checkpoints, shards, client-state files) since the last `take`."""

    def __init__(self):
        from fl_lightning import atomic_files

        self.count = 0
        original = atomic_files.replace_atomically

        def counted(write, target):
            original(write, target)
            self.count += os.path.getsize(target)

        atomic_files.replace_atomically = counted

    def take(self) -> int:
        taken, self.count = self.count, 0
        return taken


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_one(algorithm_name: str, num_clients: int, store: str, args: argparse.Namespace) -> dict:
    """One configuration, in this process: its figures."""
    from lightning.fabric import Fabric

    from fl_lightning.algorithms import MOON, SCAFFOLD
    from fl_lightning.checkpoint import NOT_SAVED, client_state_path, load_client_index
    from fl_lightning.config import ClientOptimizerArgs, ComputeArgs, DataArgs, FederationArgs, ModelArgs
    from fl_lightning.data import ClientSamples, ImageDataset
    from fl_lightning.federation.client_store import ClientStates
    from fl_lightning.federation.loop import FederatedLoop
    from fl_lightning.federation.setup import RunData, RunSettings, rank_inputs
    from fl_lightning.server_optimizers import ServerSGD

    torch.set_num_threads(1)
    memory_mib = STORE_OFF_MIB if store == "off" else args.bound_mib
    if store == "unread":  # the reference: each state read when its client trains
        ClientStates.read_ahead = lambda self, client_ids: None
    rounds, checkpoint_every = args.rounds, args.checkpoint_every
    if rounds % checkpoint_every:
        raise SystemExit("--rounds must be a multiple of --checkpoint-every: the last round's checkpoint is counted")
    per_round = args.clients_per_round or num_clients // rounds
    images, labels = random_images(POOL + 100, channels=1, image_size=8, seed=SEED)
    train = ImageDataset(images[:POOL], labels[:POOL], 10, (0.5,), (0.5,))
    test = ImageDataset(images[POOL:], labels[POOL:], 10, (0.5,), (0.5,))
    partition = ClientSamples(np.arange(2 * num_clients, dtype=np.int32) % POOL,
                              np.arange(0, 2 * num_clients + 1, 2, dtype=np.int32))
    algorithm = SCAFFOLD() if algorithm_name == "scaffold" else MOON(projection_dim=16)
    settings = RunSettings(
        algorithm=algorithm, model=ModelArgs(name="mlp", options={"hidden": 16, "depth": 1}),
        data=DataArgs(augment=False),
        federation=FederationArgs(rounds=rounds, num_clients=num_clients, clients_per_round=per_round,
                                  local_steps=1, batch_size=2),
        client_optimizer=ClientOptimizerArgs(lr=0.01), server_optimizer=ServerSGD(lr=1.0),
        compute=ComputeArgs(client_path="loop", client_state_memory_mib=memory_mib), seed=SEED,
    )
    with tempfile.TemporaryDirectory(prefix="client-state-") as out_dir:
        run = rank_inputs(settings, out_dir=Path(out_dir), run_id="benchmark", hyperparameters={},
                          data=RunData(train, test, partition))
        loop = FederatedLoop(Fabric(accelerator="cpu", devices=1, precision="32-true"), run)
        written = WrittenBytes()
        set_up = resident_mib()
        round_seconds, checkpoint_seconds, checkpoint_bytes, between_bytes = [], [], [], 0
        for round_index in range(rounds):
            started = time.perf_counter()
            loop.run_round(round_index)
            round_seconds.append(time.perf_counter() - started)
            between_bytes += written.take()
            if (round_index + 1) % checkpoint_every == 0:
                started = time.perf_counter()
                loop.save_checkpoint()
                checkpoint_seconds.append(time.perf_counter() - started)
                checkpoint_bytes.append(written.take())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        # The last round is checkpointed: its index names every client that trained, each file one size.
        versions = load_client_index(out_dir, loop.client_states.index_deltas)
        trained = np.flatnonzero(versions != NOT_SAVED)
        file_bytes = client_state_path(out_dir, int(trained[0]), int(versions[trained[0]])).stat().st_size
    return {"algorithm": algorithm_name, "clients": num_clients, "memory_mib": memory_mib,
            "set_up_rss_mib": set_up, "peak_rss_mib": peak,
            "seconds_per_round": float(np.mean(round_seconds)), "checkpoint_bytes": float(np.mean(checkpoint_bytes)),
            "checkpoint_seconds": float(np.mean(checkpoint_seconds)),
            "between_checkpoints_bytes": between_bytes, "states_in_memory": len(loop.client_states.by_client),
            "earlier_layout_checkpoint_bytes": int(file_bytes * len(trained))}


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    args = parse_args(argv)
    if args.one:
        algorithm, clients, store = args.one
        print(json.dumps(run_one(algorithm, int(clients), store, args)))
        return []
    per_round = args.clients_per_round or f"N/{args.rounds}"
    print(f"SCAFFOLD and MOON, MLP hidden 16 on 8x8 images, 2 per client, 1 step of batch 2; S = {per_round} over "
          f"{args.rounds} rounds, a checkpoint every {args.checkpoint_every}; one CPU rank of one thread per "
          f"configuration; store off: all states in memory; store on: compute.client_state_memory_mib "
          f"{args.bound_mib}")
    print(f"{'method':<9} {'N':>7} {'store':<6} {'RSS set up':>10} {'peak RSS':>9} {'s/round':>8} "
          f"{'ckpt MiB':>9} {'ckpt s':>7} {'earlier':>9} {'spilled MiB':>11}")
    results = []
    for algorithm in args.algorithms.split(","):
        for clients in args.clients:
            for store in args.stores.split(","):
                row = {**measured(algorithm, clients, store, args), "store": store}
                results.append(row)
                print(f"{algorithm:<9} {clients:>7} {store:<6} {row['set_up_rss_mib']:>10.0f} "
                      f"{row['peak_rss_mib']:>9.0f} {row['seconds_per_round']:>8.3f} "
                      f"{row['checkpoint_bytes'] / 2**20:>9.2f} {row['checkpoint_seconds']:>7.2f} "
                      f"{row['earlier_layout_checkpoint_bytes'] / 2**20:>9.2f} "
                      f"{row['between_checkpoints_bytes'] / 2**20:>11.2f}", flush=True)
    print("RSS in MiB; ckpt MiB and ckpt s: mean bytes a checkpoint writes and its seconds; earlier: what the "
          "earlier layout's last checkpoint wrote (every client's state); spilled MiB: client states written between "
          "checkpoints")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def measured(algorithm: str, clients: int, store: str, args: argparse.Namespace) -> dict:
    """One configuration in a process of its own: its figures."""
    command = [sys.executable, __file__, "--one", algorithm, str(clients), store, "--rounds", str(args.rounds),
               "--checkpoint-every", str(args.checkpoint_every), "--bound-mib", str(args.bound_mib),
               *(["--clients-per-round", str(args.clients_per_round)] if args.clients_per_round else [])]
    completed = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
