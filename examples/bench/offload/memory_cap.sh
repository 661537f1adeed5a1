#!/usr/bin/env bash
# Model states at least twice a memory cap: a 0.5 B-parameter GPT (bf16 weights, AdamW: 16 B of
# model state per parameter, 7.6 GiB) trained under a cgroup (v1 or v2) memory cap of CAP_MIB
# (default 3600: the states are 2.16x that), with its fp32 masters and AdamW state on NVMe,
# and the same job with the state in memory under the same cap. Prints each run's outcome, its
# peak RSS and the cgroup's peak. Needs root (it makes a cgroup).
# usage: examples/bench/offload/memory_cap.sh FOLDER [CAP_MIB]
set -uo pipefail
folder=$1 cap_mib=${2:-3600}
root=$(cd "$(dirname "$0")/../../.." && pwd)
loom=$root/build/bin/loom
cap=$((cap_mib * 1024 * 1024))
work=$(mktemp -d)
if [ -d /sys/fs/cgroup/memory ]; then  # v1
  cg=/sys/fs/cgroup/memory/loom-cap-$$
  mkdir "$cg" || exit 1
  echo "$cap" >"$cg/memory.limit_in_bytes"
  [ -f "$cg/memory.memsw.limit_in_bytes" ] && echo "$cap" >"$cg/memory.memsw.limit_in_bytes"
  peak_file=$cg/memory.max_usage_in_bytes
else  # v2
  cg=/sys/fs/cgroup/loom-cap-$$
  mkdir "$cg" || exit 1
  echo "$cap" >"$cg/memory.max"
  echo 0 >"$cg/memory.swap.max" 2>/dev/null
  peak_file=$cg/memory.peak
fi
trap 'rm -rf "$work"; rmdir "$cg" 2>/dev/null' EXIT
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), cap ${cap_mib} MiB"
for mode in nvme memory; do
  sets=(--set "train.output_dir=$work/$mode" --set train.max_steps=2 --set model.n_embd=1536
        --set model.n_layer=18 --set 'train.log_level="info"')
  [ $mode = nvme ] && sets+=(--set "zero.offload_optimizer={device=\"nvme\", nvme_path=\"$folder\"}")
  [ -f "$cg/memory.max_usage_in_bytes" ] && echo 0 >"$cg/memory.max_usage_in_bytes"
  start=$(date +%s)
  bash -c "echo \$\$ >$cg/cgroup.procs; exec $loom run $root/examples/bench/offload/gpt_bf16.toml $(printf '%q ' "${sets[@]}")" \
    >"$work/$mode.log" 2>&1
  rc=$?
  echo "--- state in $mode: exit $rc after $(($(date +%s) - start)) s; cgroup peak $(($(cat "$peak_file") / 1048576)) MiB"
  grep -E "model gpt:|offload:|done:" "$work/$mode.log" | cut -c1-220
  [ -f "$work/$mode/metrics.jsonl" ] && python3 -c "
import json,sys
for l in open('$work/$mode/metrics.jsonl'):
    j=json.loads(l); print('  step', j['step'], 'loss %.3f' % j['loss'], 'rss_peak %.0f MiB' % (j['rss_peak_bytes']/2**20), 'update %.1f s' % j.get('offload_update_s', 0))"
done
