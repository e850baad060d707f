"""Seconds per round of one-rank CPU runs under each way of choosing torch's threads, on a quiet
machine and beside busy loops (other work on the machine: a browser, another user, a login node).

Each measurement is `fl-lightning fit` in a fresh process (OpenMP reads its wait policy once, when
torch loads), with `--fabric.devices 1` on the CPU, W&B off, no checkpoint but the last; its
`round_seconds` are read from metrics.jsonl and the median over the rounds after the first is
reported. Busy loops are processes spinning in Python, started before the run and stopped after it.

Candidates:

    auto          fl-lightning's own choice (`compute.cpu_threads: auto`, what the start line prints)
    1 thread      OMP_NUM_THREADS=1
    cores         OMP_NUM_THREADS = the cores this process may use (torch's default), OpenMP's
                  default wait policy (threads spin a while before they sleep)
    cores passive the same with OMP_WAIT_POLICY=PASSIVE (waiting threads sleep at once)
    cores spin=N  the same with GOMP_SPINCOUNT=N (a waiting thread spins N times, then sleeps;
                  libgomp's default is 300000, and 1000 when it has more threads than CPUs)

Workloads (FedAvg, the client SGD of each setting):

    quickstart    configs/quickstart.yaml: an MLP on the bundled digits, 5 clients x 20 steps of 32
    ctpfl-small   LeNet-5 on CIFAR-10, the CTP-FL setting cut to 10 clients x 5 steps of 10
    W1, W2        docs/performance.md's LeNet-5 workloads: 10 clients x 50 steps of 50, and 50 clients
                  x 5 steps of 10 (of 100 and 1000)
    resnet18      ResNet-18 on CIFAR-10, 2 clients x 2 steps of 32 (a model big enough for threads)

    python benchmarks/cpu_threads.py                          # every workload and candidate, quiet and busy
    python benchmarks/cpu_threads.py --workloads quickstart W1 --busy 4 --rounds 4 --json threads.json

A run that exceeds --limit seconds is stopped, and its figure is what it measured until then
(marked >, or `-` when no round finished). CIFAR-10 is read from --data-root (cifar-10-batches-py/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

REPOSITORY = Path(__file__).resolve().parents[1]
SETTING = "configs/settings/cifar10_lenet5_ctpfl.yaml"
FEDAVG = "configs/algorithms/fedavg.yaml"


def lenet5(clients: int, per_round: int, steps: int, batch: int) -> list[str]:
    return ["--config", SETTING, "--config", FEDAVG, "--federation.num_clients", str(clients),
            "--federation.clients_per_round", str(per_round), "--federation.local_steps", str(steps),
            "--federation.batch_size", str(batch), "--data.augment", "false"]


WORKLOADS = {
    "quickstart": ["--config", "configs/quickstart.yaml"],
    "ctpfl-small": lenet5(10, 10, 5, 10),
    "W1": lenet5(100, 10, 50, 50),
    "W2": lenet5(1000, 50, 5, 10),
    "resnet18": [*lenet5(10, 2, 2, 32), "--model.name", "resnet18", "--model.norm", "bn"],
}
CIFAR_WORKLOADS = {"ctpfl-small", "W1", "W2", "resnet18"}
CANDIDATES = ("auto", "1 thread", "cores", "cores passive", "cores spin=1000", "cores spin=10000",
              "cores spin=100000")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def environment(candidate: str) -> dict[str, str]:
    variables = {name: value for name, value in os.environ.items() if name not in THREAD_VARIABLES}
    if candidate == "1 thread":
        variables["OMP_NUM_THREADS"] = "1"
    elif candidate.startswith("cores"):
        variables["OMP_NUM_THREADS"] = str(cores())
        if candidate == "cores passive":
            variables["OMP_WAIT_POLICY"] = "PASSIVE"
        elif candidate.startswith("cores spin="):
            variables["GOMP_SPINCOUNT"] = candidate.removeprefix("cores spin=")
    return variables


def start_busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def round_seconds(out_dir: Path) -> list[float]:
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line)["round_seconds"])
        except (json.JSONDecodeError, KeyError):
            break
    return rows


def measure(workload: str, candidate: str, busy: int, rounds: int, limit: float, data_root: Path,
            folder: Path) -> dict:
    """One run: its seconds per round (the median after the first round) and the threads it printed."""
    out_dir = folder / f"{workload}-{candidate.replace(' ', '_').replace('=', '')}-busy{busy}"
    command = [sys.executable, "-m", "fl_lightning", "fit", *WORKLOADS[workload],
               "--federation.rounds", str(rounds), "--federation.eval_every", str(rounds),
               "--checkpoint.every", str(rounds), "--fabric.accelerator", "cpu", "--fabric.devices", "1",
               "--logger.wandb_mode", "disabled", "--logger.progress_bar", "false",
               "--data.root", str(data_root), "--out_dir", str(out_dir), "--resume", "null"]
    loops = start_busy_loops(busy)
    started = time.monotonic()
    try:
        with open(folder / f"{out_dir.name}.log", "w") as log:
            process = subprocess.Popen(command, cwd=REPOSITORY, env=environment(candidate), stdout=log,
                                       stderr=subprocess.STDOUT)
            try:
                process.wait(timeout=limit)
                stopped = False
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                stopped = True
    finally:
        stop(loops)
    seconds = round_seconds(out_dir)
    if process.returncode not in (0, -9) or (not stopped and len(seconds) < rounds):
        tail = (folder / f"{out_dir.name}.log").read_text().splitlines()[-15:]
        raise SystemExit(f"{workload} / {candidate} failed ({process.returncode}):\n" + "\n".join(tail))
    timed = seconds[1:] or seconds
    threads = next((line.split("torch threads:", 1)[1].strip() for line in
                    (folder / f"{out_dir.name}.log").read_text().splitlines() if "torch threads:" in line), None)
    return {"workload": workload, "candidate": candidate, "busy_loops": busy, "rounds_timed": len(timed),
            "seconds_per_round": statistics.median(timed) if timed else None, "stopped_at_limit": stopped,
            "wall_seconds": round(time.monotonic() - started, 1), "threads_printed": threads}


def describe(result: Optional[dict]) -> str:
    if result is None or result["seconds_per_round"] is None:
        return "-"
    return (">" if result["stopped_at_limit"] else "") + f"{result['seconds_per_round']:.3g}"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--busy", type=int, default=4, help="busy loops beside the busy runs (default: 4)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each run, the first not timed (default: 4)")
    parser.add_argument("--limit", type=float, default=180.0,
                        help="seconds after which a run is stopped (default: 180)")
    parser.add_argument("--data-root", type=Path, default=REPOSITORY / "data",
                        help="folder holding cifar-10-batches-py (default: the repository's data/)")
    parser.add_argument("--json", type=Path, default=None, help="write the settings and every figure to this file")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    args = parse_args(argv)
    if CIFAR_WORKLOADS & set(args.workloads) and not (args.data_root / "cifar-10-batches-py").is_dir():
        raise SystemExit(f"{args.data_root / 'cifar-10-batches-py'} is missing: give --data-root, or leave the "
                         f"CIFAR-10 workloads out (--workloads quickstart)")
    print(f"{platform.processor() or platform.machine()}, {cores()} cores; busy runs beside {args.busy} busy "
          f"loop(s); seconds per round, median of rounds 2-{args.rounds}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="fl-lightning-threads-") as folder:
        for workload in args.workloads:
            for candidate in args.candidates:
                for busy in (0, args.busy):
                    results.append(measure(workload, candidate, busy, args.rounds, args.limit, args.data_root,
                                           Path(folder)))
                    print(f"  {workload} / {candidate} / {busy} busy: {describe(results[-1])} s "
                          f"(threads: {results[-1]['threads_printed']})", flush=True)
    by_key = {(r["workload"], r["candidate"], r["busy_loops"]): r for r in results}
    header = ["workload", "candidate", "quiet s/round", f"busy ({args.busy}) s/round", "busy / quiet",
              "busy / 1 thread busy"]
    rows = []
    for workload in args.workloads:
        for candidate in args.candidates:
            quiet, busy = by_key[workload, candidate, 0], by_key[workload, candidate, args.busy]
            one = by_key.get((workload, "1 thread", args.busy))
            ratio = (f"{busy['seconds_per_round'] / quiet['seconds_per_round']:.2g}"
                     if busy["seconds_per_round"] and quiet["seconds_per_round"] else "-")
            to_one = (f"{busy['seconds_per_round'] / one['seconds_per_round']:.2g}"
                      if one and busy["seconds_per_round"] and one["seconds_per_round"] else "-")
            rows.append([workload, candidate, describe(quiet), describe(busy), ratio, to_one])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if args.json is not None:
        args.json.write_text(json.dumps({"cores": cores(), "busy_loops": args.busy, "rounds": args.rounds,
                                         "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
