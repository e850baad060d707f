"""Host synchronisations per fl-lightning round on CUDA, at K and at 2K local steps.

A client's steps must not wait on the host (no `.item()`, no transfer per step), so the number of
synchronising CUDA calls in a round may depend on its clients but not on their steps. Each
fl-lightning method of benchmarks/throughput.py (its algorithms on the loop and the grouped client
path) runs one warm-up round, then one round under `torch.cuda.set_sync_debug_mode("warn")`, which
turns every synchronising call into a warning; the warnings are counted. Exit status 1 when a
method synchronises more often at 2K steps than at K.

    python benchmarks/host_syncs.py                       # on a CUDA machine
    python benchmarks/host_syncs.py --model resnet18 --local-steps 4 --json syncs.json
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch
from lightning.fabric import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks, also when loaded by path
from throughput import ALGORITHMS, FlLightning, Workload, algorithm_list, build_methods  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="lenet5")
    parser.add_argument("--clients", type=int, default=4, help="clients per round (default: 4)")
    parser.add_argument("--local-steps", type=int, default=3, help="K; the second round takes 2K (default: 3)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="bf16-mixed")
    parser.add_argument("--algorithms", type=algorithm_list, default=list(ALGORITHMS),
                        help=f"comma-separated, from {','.join(ALGORITHMS)} (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="write the counts to this JSON file")
    return parser.parse_args(argv)


def synchronisations(method: FlLightning, round_index: int) -> int:
    """The synchronising CUDA calls of one round of `method`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            method.run_round(round_index)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("host_syncs: needs a CUDA device (torch sees none)", file=sys.stderr)
        return 2
    fabric = Fabric(accelerator="cuda", devices=1, precision=args.precision)
    counts: dict[str, dict[int, int]] = {}
    for steps in (args.local_steps, 2 * args.local_steps):
        workload = Workload(args.clients, steps, args.batch_size, fabric.device)
        methods = [method for method in build_methods(fabric, args.model, workload, args.algorithms)
                   if isinstance(method, FlLightning)]
        for method in methods:
            method.run_round(0)  # warm-up: lazy initialisation stays out of the count
            counts.setdefault(method.name, {})[steps] = synchronisations(method, 1)
    grows = [name for name, by_steps in counts.items() if by_steps[2 * args.local_steps] > by_steps[args.local_steps]]
    print(f"{args.model}, {args.clients} clients x batch {args.batch_size}, {args.precision}, "
          f"{torch.cuda.get_device_name(fabric.device)}: synchronising CUDA calls per round")
    print(f"{'method':<36}{f'K={args.local_steps}':>8}{f'K={2 * args.local_steps}':>8}")
    for name, by_steps in counts.items():
        print(f"{name:<36}{by_steps[args.local_steps]:>8}{by_steps[2 * args.local_steps]:>8}"
              f"{'  grows with K' if name in grows else ''}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": {**vars(args), "json": str(args.json),
                                                      "device_name": torch.cuda.get_device_name(fabric.device),
                                                      "torch": torch.__version__},
                                         "counts": counts, "grows_with_steps": grows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if grows else 0


if __name__ == "__main__":
    sys.exit(main())
