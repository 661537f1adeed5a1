#!/usr/bin/env bash
# Note [Frozen weights in half]: a LoRA fine-tune of GPT-2 124M (r 8 on every Linear of each
# block, "all-linear") under bf16 autocast, batch 4 x sequence 256, with the frozen base Linears
# held in bf16 ([precision] frozen_weights = "half", the default) against held in fp32 and cast
# at each forward ("fp32", what PyTorch's autocast does), interleaved. Per run: the median step
# time over steps 2..STEPS, the tracked allocator's peak and its bytes held after the last step,
# the process's peak RSS; then the median over ROUNDS rounds. --checkpointing adds activation
# checkpointing of every block (its recompute casts the frozen weights a second time).
# usage: frozen_half.sh [ROUNDS] [STEPS] [--checkpointing]
set -euo pipefail
rounds=${1:-3} steps=${2:-5} mode=${3:-}
root=$(cd "$(dirname "$0")/../../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
job="$work/job.toml"
cat "$root/examples/bench/gpt2_step/gpt2_124m.toml" > "$job"
printf '\n[lora]\nr = 8\nlora_alpha = 16\ntarget_modules = "all-linear"\nsave_adapter = false\n' >> "$job"
[ "$mode" = --checkpointing ] && printf '\n[checkpointing]\nevery = 1\n' >> "$job"
for round in $(seq "$rounds"); do
  order=(half fp32)
  [ $((round % 2)) -eq 0 ] && order=(fp32 half)
  for frozen in "${order[@]}"; do
    "$root/build/bin/loom" run "$job" \
      --set "train.output_dir=$work/$frozen-$round" --set "train.max_steps=$steps" \
      --set train.num_threads=2 --set 'precision.mode="bf16"' \
      --set "precision.frozen_weights=\"$frozen\"" >"$work/$frozen-$round.log" 2>&1 ||
      { tail -5 "$work/$frozen-$round.log"; exit 1; }
  done
done
python3 - "$work" "$rounds" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
mib = lambda b: b / 2**20
res = {}
for frozen in ("half", "fp32"):
    runs = []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{work}/{frozen}-{r}/metrics.jsonl")]
        runs.append((statistics.median(x["step_time_s"] for x in lines[1:]),
                     lines[-1]["mem_peak_bytes"], lines[-1]["mem_current_bytes"],
                     lines[-1]["rss_peak_bytes"]))
    res[frozen] = [statistics.median(x[i] for x in runs) for i in range(4)]
    t, peak, held, rss = res[frozen]
    print(f"frozen_weights = {frozen}: step {t:.3f} s (runs: {', '.join(f'{x[0]:.3f}' for x in runs)}), "
          f"peak {mib(peak):.0f} MiB, held after a step {mib(held):.0f} MiB, peak RSS {mib(rss):.0f} MiB")
h, f = res["half"], res["fp32"]
print(f"half / fp32: step time {h[0] / f[0]:.3f}, peak {h[1] / f[1]:.3f} ({mib(f[1] - h[1]):.0f} MiB less), "
      f"held {h[2] / f[2]:.3f}, peak RSS {h[3] / f[3]:.3f}")
PY
