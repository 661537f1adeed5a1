#!/usr/bin/env bash
# Stage-3 parameter offload's read-ahead (Note [Offloaded parameters]): the offload benchmark's
# 0.2 B GPT at stage 3, batch 8 of 16 tokens (so each unit computes for about as long as its
# shard takes to read), its weights in memory; its shards on NVMe read a unit ahead; and the
# same with stage3_prefetch_bucket_size = 0 (each shard read when its gather starts). Steps
# 2-4's medians of step time and of the time gathers waited for a shard, peak RSS, ROUNDS
# rounds in rotation.
# usage: param_readahead.sh NVME_FOLDER [ROUNDS]
set -euo pipefail
folder=${1:?usage: param_readahead.sh NVME_FOLDER [ROUNDS]} rounds=${2:-3}
root=$(cd "$(dirname "$0")/../../.." && pwd)
loom=$root/build/bin/loom
mkdir -p "$folder"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
P="zero.offload_param={device=\"nvme\", nvme_path=\"$folder\"}"
for round in $(seq "$rounds"); do
  for cfg in memory readahead no_prefetch; do
    out=$work/$cfg-$round
    args=(--set "train.output_dir=$out" --set train.max_steps=4 --set zero.stage=3
          --set train.per_device_train_batch_size=8 --set train.num_threads=2)
    [ $cfg != memory ] && args+=(--set "$P")
    [ $cfg == no_prefetch ] && args+=(--set zero.stage3_prefetch_bucket_size=0)
    /usr/bin/time -f "%M" -o "$out.rss" "$loom" run "$root/examples/bench/offload/gpt_bf16.toml" \
      "${args[@]}" >/dev/null 2>"$out.log" || { cat "$out.log"; exit 1; }
  done
done
python3 - "$work" "$rounds" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
print("| stage 3 weights | step s (median of rounds) | waiting for shard reads s | peak RSS GiB |")
print("|---|---|---|---|")
for cfg, label in [("memory", "in memory"), ("readahead", "shards on NVMe, read a unit ahead"),
                   ("no_prefetch", "shards on NVMe, read at the gather (no prefetch)")]:
    step, wait, rss = [], [], []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{work}/{cfg}-{r}/metrics.jsonl")][1:]
        step.append(statistics.median(x["step_time_s"] for x in lines))
        wait.append(statistics.median(x.get("offload_param_wait_s", 0) for x in lines))
        rss.append(int(open(f"{work}/{cfg}-{r}.rss").read().split()[-1]) / 2**20)
    print(f"| {label} | {statistics.median(step):.2f} ({', '.join(f'{s:.2f}' for s in step)}) "
          f"| {statistics.median(wait):.3f} | {max(rss):.2f} |")
PY
