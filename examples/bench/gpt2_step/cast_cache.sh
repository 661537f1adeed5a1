#!/usr/bin/env bash
# Note [Cast once per update]: GPT-2 124M under bf16 autocast with gradient accumulation
# (per-device batch 1 x 4 micro-batches, sequence 256), [precision] cast_cache = "step" (the
# weights cast to bf16 once per update) against "forward" (cast again each micro-batch, as
# PyTorch's autocast does), interleaved; each run's median step time over steps 2..STEPS, then
# the median over ROUNDS rounds.
# usage: cast_cache.sh [ROUNDS] [STEPS]
set -euo pipefail
rounds=${1:-3} steps=${2:-5}
root=$(cd "$(dirname "$0")/../../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for round in $(seq "$rounds"); do
  for cache in step forward; do
    "$root/build/bin/loom" run "$root/examples/bench/gpt2_step/gpt2_124m.toml" \
      --set "train.output_dir=$work/$cache-$round" --set "train.max_steps=$steps" \
      --set train.num_threads=2 --set train.per_device_train_batch_size=1 \
      --set train.gradient_accumulation_steps=4 --set 'precision.mode="bf16"' \
      --set "precision.cast_cache=\"$cache\"" >"$work/$cache-$round.log" 2>&1 ||
      { tail -5 "$work/$cache-$round.log"; exit 1; }
  done
done
python3 - "$work" "$rounds" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
med = {}
for cache in ("step", "forward"):
    runs = []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{work}/{cache}-{r}/metrics.jsonl")][1:]
        runs.append(statistics.median(x["step_time_s"] for x in lines))
    med[cache] = statistics.median(runs)
    print(f"cast_cache = {cache}: {med[cache]:.3f} s a step (runs: {', '.join(f'{x:.3f}' for x in runs)})")
print(f"step / forward: {med['step'] / med['forward']:.3f}")
PY
