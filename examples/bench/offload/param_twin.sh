#!/usr/bin/env bash
# Stage-3 parameter offload's staged path on the CPU twin (Note [Parameter offload twin],
# LOOM_OFFLOAD_CPU_STORE=1: the GPU's code, its "device" the CPU) against stage 3 in memory and
# the unstaged NVMe path: GPT 8 x 256 (6.4 M parameters), full_bf16, AdamW, stage 3 on one
# rank, 8 steps, one compute thread (two threads on a loaded 2-core VM swing several-fold:
# libgomp spinning); the four runs of a round one after the other, rounds repeated; per run the
# median over steps 3-8 of step_time_s and of offload_param_wait_s (what gathers waited for a
# fetch). The final losses agree (bitwise weights: tests/offload).
# usage: examples/bench/offload/param_twin.sh NVME_FOLDER [ROUNDS] (from the repository root)
set -euo pipefail
folder=${1:?usage: param_twin.sh NVME_FOLDER [ROUNDS]} rounds=${2:-3}
mkdir -p "$folder"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
job=(--set train.model='"gpt"' --set train.max_steps=8 --set train.num_threads=1 --set train.per_device_train_batch_size=4
     --set train.learning_rate=1e-3 --set train.save_strategy='"no"'
     --set train.logging_steps=1000 --set train.progress_bar=false --set train.log_level='"warn"'
     --set model.vocab_size=256 --set model.n_positions=128 --set model.n_embd=256
     --set model.n_layer=8 --set model.n_head=8 --set data.source='"random_tokens"'
     --set data.num_samples=256 --set data.seq_len=128 --set data.vocab_high=256
     --set zero.stage=3 --set zero.stage3_param_persistence_threshold=0
     --set precision.mode='"full_bf16"')
printf '[train]\n[model]\n[data]\ntask = "lm"\n[zero]\n[precision]\n' >"$work/job.toml"
nvme="{ device = \"nvme\", nvme_path = \"$folder\" }"
for round in $(seq "$rounds"); do
  for cfg in memory twin_cpu twin_nvme nvme; do
    extra=() twin=0
    case $cfg in
      twin_cpu) extra=(--set 'zero.offload_param={ device = "cpu" }'); twin=1 ;;
      twin_nvme) extra=(--set "zero.offload_param=$nvme"); twin=1 ;;
      nvme) extra=(--set "zero.offload_param=$nvme") ;;
    esac
    LOOM_OFFLOAD_CPU_STORE=$twin build/bin/loom run "$work/job.toml" \
      --set "train.output_dir=$work/$cfg-$round" "${job[@]}" "${extra[@]}" \
      >"$work/$cfg-$round.log" 2>&1 || { tail -3 "$work/$cfg-$round.log"; exit 1; }
    .venv/bin/python - "$work/$cfg-$round/metrics.jsonl" "$cfg" "$round" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
median = lambda key: statistics.median(x.get(key, 0.0) for x in lines[2:])
print(f"round {sys.argv[3]} {sys.argv[2]:9s} step {median('step_time_s'):.3f} s  "
      f"fetch waited {median('offload_param_wait_s'):.4f} s  final loss {lines[-1]['loss']:.6f}")
PY
  done
done
