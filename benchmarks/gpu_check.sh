#!/usr/bin/env bash
# The GPU check: benchmarks/throughput.py at the papers' shapes, one JSON file with every figure.
#
#   LeNet-5   at CIFAR-10 shape  (3x32x32, 10 classes)
#   ResNet-18 at CIFAR-100 shape (3x32x32, 100 classes)
#   ViT-Tiny  at CIFAR-100 shape (vit_tiny: width 192, depth 12, patch 4 at 32x32)
#
# each with S=10 clients per round, K=50 local steps, batch B=50, bf16-mixed, on one CUDA device:
# centralised training at batch S*B (the ceiling), the naive client-by-client FedAvg loop, and
# fl-lightning FedAvg, SCAFFOLD, FedProx and CTP-FL on the loop and the grouped client path; one
# warm-up round, then the median of 2 timed rounds per method, each method's peak CUDA memory, and
# for fl-lightning the share of its last timed round spent outside its clients' updates.
#
#   bash benchmarks/gpu_check.sh          # from the repository root; the venv active or at .venv
#
# Writes $OUT/gpu_check.json when OUT is set, else benchmarks/gpu_check.json (GPU_CHECK_JSON
# overrides both), prints each shape's table and a summary, and exits non-zero if any shape or
# method failed (the figures of the others are still written). On CUDA it then counts the host
# synchronisations of a round at K and 2K local steps (benchmarks/host_syncs.py, into the same JSON)
# and fails if they grow with K. Every setting can be overridden
# for a tiny CPU run of the same code, e.g.
#
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_CLIENTS=2 GPU_CHECK_STEPS=2 GPU_CHECK_BATCH=4 GPU_CHECK_REPEATS=1 \
#       bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
    PYTHON=$GPU_CHECK_PYTHON
elif [[ -n "${VIRTUAL_ENV:-}" ]]; then
    PYTHON=python
elif [[ -x .venv/bin/python ]]; then
    PYTHON=.venv/bin/python
else
    PYTHON=python3
fi
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PRECISION=${GPU_CHECK_PRECISION:-bf16-mixed}
CLIENTS=${GPU_CHECK_CLIENTS:-10}
STEPS=${GPU_CHECK_STEPS:-50}
BATCH=${GPU_CHECK_BATCH:-50}
REPEATS=${GPU_CHECK_REPEATS:-2}
ALGORITHMS=${GPU_CHECK_ALGORITHMS:-fedavg,scaffold,fedprox,ctpfl}
# model:classes, at 3x32x32
SHAPES=${GPU_CHECK_SHAPES:-lenet5:10 resnet18:100 vit_tiny:100}
EXTRA=${GPU_CHECK_EXTRA:-}  # more throughput.py options, e.g. --channels-last or --group-size 5
if [[ -n "${GPU_CHECK_JSON:-}" ]]; then
    JSON=$GPU_CHECK_JSON
elif [[ -n "${OUT:-}" ]]; then
    JSON=$OUT/gpu_check.json
else
    JSON=benchmarks/gpu_check.json
fi

# Merges the shapes run so far into $JSON (after every shape, so that a run cut short by a time
# limit still leaves the finished shapes' figures); with "table", also prints the summary.
merge() {
    "$PYTHON" - "$JSON" "$PARTS" "$((SECONDS - started))" "$1" "${runs[@]}" <<'EOF'
"""Merge the shapes' JSON files into one and print the summary table."""
import json
import sys
from pathlib import Path

out, parts, total_seconds, table = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "table"
runs = sys.argv[5:]
shapes = []
for run in runs:
    model, code, seconds = run.rsplit(":", 2)
    part = parts / f"{model}.json"
    report = json.loads(part.read_text()) if part.is_file() else {}
    shapes.append({"model": model, "exit_status": int(code), "wall_seconds": int(seconds), **report})
first = next((shape["settings"] for shape in shapes if "settings" in shape), {})
common = {key: first.get(key) for key in ("device", "device_name", "torch", "cuda", "python", "precision",
                                          "channels_last", "clients", "local_steps", "batch_size", "algorithms",
                                          "warm_up_rounds", "timed_rounds", "git_commit", "date")}
failed = [shape["model"] for shape in shapes if shape["exit_status"] != 0]
report = {"settings": common, "wall_seconds": total_seconds, "failed": failed, "shapes": shapes}
if (parts / "host_syncs.json").is_file():
    report["host_syncs"] = json.loads((parts / "host_syncs.json").read_text())
out.write_text(json.dumps(report, indent=2) + "\n")
if not table:
    sys.exit(0)
print(f"\nsummary ({common.get('device_name') or common.get('device')}, torch {common.get('torch')}, "
      f"{common.get('precision')}; {total_seconds} s in all)")
print(f"{'model':<10}{'method':<32}{'samples/s':>12}{'vs ceiling':>12}{'vs naive':>10}{'outside':>9}"
      f"{'peak MiB':>10}")
for shape in shapes:
    for row in shape.get("results", []):
        if "error" in row:
            print(f"{shape['model']:<9} {row['method']:<32}  FAILED: {row['error']}")
            continue
        peak, outside = row.get("peak_memory_bytes"), row.get("outside_clients")
        print(f"{shape['model']:<9} {row['method']:<32}{row['samples_per_second']:>12.0f}"
              f"{row['vs_centralised']:>12.2f}{row['vs_naive_loop']:>10.2f}"
              f"{'-' if outside is None else f'{100 * outside:.1f}%':>9}"
              f"{'-' if peak is None else f'{peak / 2**20:.0f}':>10}")
    if "results" not in shape:
        print(f"{shape['model']:<9} FAILED (exit status {shape['exit_status']}, no results)")
print(f"wrote {out}")
EOF
}

mkdir -p "$(dirname "$JSON")"
PARTS=$(mktemp -d)
trap 'rm -rf "$PARTS"' EXIT
status=0
runs=()
started=$SECONDS
echo "gpu_check: $PYTHON on $DEVICE, $PRECISION, S=$CLIENTS K=$STEPS B=$BATCH, 1 warm-up + $REPEATS timed rounds," \
     "algorithms $ALGORITHMS, shapes: $SHAPES"
for shape in $SHAPES; do
    model=${shape%%:*}
    classes=${shape##*:}
    shape_started=$SECONDS
    echo
    echo "== $model, 3x32x32, $classes classes =="
    # shellcheck disable=SC2086  # EXTRA is a list of options
    "$PYTHON" benchmarks/throughput.py --model "$model" --channels 3 --image-size 32 --num-classes "$classes" \
        --clients "$CLIENTS" --local-steps "$STEPS" --batch-size "$BATCH" --repeats "$REPEATS" \
        --device "$DEVICE" --precision "$PRECISION" --algorithms "$ALGORITHMS" $EXTRA --json "$PARTS/$model.json"
    code=$?
    seconds=$((SECONDS - shape_started))
    echo "== $model: exit status $code, $seconds s =="
    [[ $code -eq 0 ]] || status=1
    runs+=("$model:$code:$seconds")
    merge quiet || status=1
done

if [[ $DEVICE == cuda ]]; then
    echo
    echo "== host synchronisations per round, at K and 2K local steps =="
    "$PYTHON" benchmarks/host_syncs.py --precision "$PRECISION" --algorithms "$ALGORITHMS" \
        --json "$PARTS/host_syncs.json" || status=1
fi

merge table || status=1
[[ $status -eq 0 ]] || echo "gpu_check: FAILED (see above)" >&2
exit $status
