#!/usr/bin/env bash
# How big a GPT trains on this machine with 4 ranks: DDP ([zero] stage 0) and stage 3, each for
# 2 steps (fp32, AdamW, batch 1 x 128 tokens per rank, gloo). Prints rank 0's model state and
# peak RSS and the machine's peak used memory (sampled every second from `free`).
# The weights stay sharded at the end (stage3_gather_weights_at_end = false): gathering them
# whole on every rank would need the whole model four times over.
# At stage 3 the model is built a unit at a time, each cut to the rank's chunk as it is
# initialised ([zero] sharded_init, the default: Note [Sharded initialization] in loom/nn.h);
# SHARDED_INIT = false builds it whole on every rank first, as before. Rank 0's start-up peak
# (the memory tracker's, setup to params_ready) is printed beside its shard then.
# Further arguments go to `loom run` as they are (e.g. --set checkpointing.every=1 to recompute
# every unit's activations in backward).
# usage: examples/bench/zero/largest.sh STAGE N_EMBD N_LAYER [SHARDED_INIT [--set KEY=VALUE ...]]
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
stage=$1 embd=$2 layers=$3 sharded_init=${4:-true}
shift $(($# < 4 ? $# : 4))
sharded=()
[ "$stage" = 3 ] && sharded=(--set "zero.sharded_init=$sharded_init")
out=$(mktemp -d)
trap 'rm -rf "$out"; kill $(jobs -p) 2>/dev/null || true' EXIT
( peak=0; while true; do used=$(free -b | awk '/^Mem:/ {print $3}'); ((used > peak)) && peak=$used;
  echo "$peak" >"$out/peak"; sleep 1; done ) &
"$root/build/bin/loom-launch" --nproc-per-node 4 --master-port $((29900 + RANDOM % 100)) \
  "$root/build/bin/loom" run "$root/examples/bench/zero/zero_bench.toml" \
  --set "train.output_dir=$out/run" --set train.max_steps=2 --set "zero.stage=$stage" \
  --set "model.n_embd=$embd" --set "model.n_layer=$layers" --set "model.n_head=$((embd / 64))" \
  --set distributed.timeout_seconds=1800 --set zero.stage3_gather_weights_at_end=false \
  "${sharded[@]}" "$@" >"$out/log" 2>&1 || { tail -5 "$out/log"; exit 1; }
"$root/.venv/bin/python" - "$out" "$stage" <<'PY'
import json, sys
out, stage = sys.argv[1], sys.argv[2]
run = json.load(open(out + "/run/run.json"))
rows = [json.loads(l) for l in open(out + "/run/metrics.jsonl")]
peak = int(open(out + "/peak").read())
print(f"stage {stage}: {run['model_state']['params'] / 1e9:.2f} B params, 4 ranks: step "
      f"{rows[-1]['step_time_s']:.0f} s, rank 0 model state "
      f"{rows[0].get('zero_model_state_measured_bytes', 0) / 2**30:.2f} GiB, rank 0 peak tracked "
      f"{max(r['mem_peak_bytes'] for r in rows) / 2**30:.2f} GiB, rank 0 peak RSS "
      f"{max(r['rss_peak_bytes'] for r in rows) / 2**30:.2f} GiB, machine peak used {peak / 2**30:.1f} GiB")
# zero's line: "stage 3 start-up peak P B (...), this rank's shard S B (...)"
for line in open(out + "/log"):
    if line.startswith("[rank 0]") and "start-up peak" in line:
        words = line.split()
        peak_at = words.index("peak") + 1
        shard_at = words.index("shard") + 1
        print(f"rank 0 start-up peak {int(words[peak_at]) / 2**30:.2f} GiB, shard "
              f"{int(words[shard_at]) / 2**30:.2f} GiB"
              f"{' (built a unit at a time)' if 'sharded initialization' in line else ''}")
PY
