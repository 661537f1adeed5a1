#!/usr/bin/env bash
# The largest GPT this machine trains with NVMe offload: a 3.5 B-parameter GPT (3072 wide, 31
# layers, byte vocabulary; bf16 weights and gradients in RAM, fp32 masters and AdamW moments on
# NVMe: 16 B of model state per parameter, 56 GB, more than twice this VM's 24 GiB of RAM), a
# few steps on the same 16-token sample, so the loss must fall. At lr 1e-6: at 1e-4 and 1e-5
# AdamW's first, sign-like steps move all 3.5 B weights at once and the loss rose (5.9 -> 10.3,
# and 5.9 -> 3.3 -> 6.8). Prints `loom estimate`'s rows for 3.5 B parameters first, then each
# step's loss, time, update time and peak RSS.
# usage: examples/bench/offload/largest.sh NVME_FOLDER [STEPS]
set -euo pipefail
folder=$1 steps=${2:-4}
root=$(cd "$(dirname "$0")/../../.." && pwd)
loom=$root/build/bin/loom
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sets=(--set "train.output_dir=$work/run" --set "train.max_steps=$steps" --set model.n_embd=3072
      --set model.n_layer=31 --set model.n_head=24 --set data.num_samples=1
      --set train.learning_rate=1e-6
      --set 'train.log_level="info"'
      --set "zero.offload_optimizer={device=\"nvme\", nvme_path=\"$folder\"}")
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(free -g | awk '/Mem:/ {print $2}') GiB RAM"
# 12 x 3072^2 x 31 blocks + embeddings: the model states alone (a job estimate would build it).
"$loom" estimate --params 3.51e9 | grep -E "^loom estimate|^0 +(none|nvme) +full_bf16"
start=$(date +%s)
"$loom" run "$root/examples/bench/offload/gpt_bf16.toml" "${sets[@]}" >"$work/run.log" 2>&1 || {
  tail -20 "$work/run.log"; exit 1; }
echo "done in $(($(date +%s) - start)) s"
grep -E "model gpt:|offload:|done:" "$work/run.log" | cut -c1-240
python3 -c "
import json
for l in open('$work/run/metrics.jsonl'):
    j = json.loads(l)
    print('  step', j['step'], 'loss %.4f' % j['loss'], 'step %.1f s' % j['step_time_s'],
          'update %.1f s' % j.get('offload_update_s', 0), 'rss_peak %.2f GiB' % (j['rss_peak_bytes'] / 2**30))"
