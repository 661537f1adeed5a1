#!/usr/bin/env bash
# The host store's overlapped update (Note [Overlapped update]) against the same store updating
# after backward (overlap_update = false) and the in-memory stage 0 driver, on the CPU twin
# (LOOM_OFFLOAD_CPU_STORE=1): GPT 8 x 256, fp32, AdamW, max_grad_norm = 0, 12 steps; the three
# runs of a round one after the other, rounds repeated; per run the median over steps 3-12 of
# step_time_s and of offload_update_s (what update() still waited for after backward). The
# final losses of the three agree (bitwise weights: tests/offload).
# usage: examples/bench/offload/overlap.sh [ROUNDS] (from the repository root; LOOM_BENCH_SETS
# adds --set options to every run, e.g. "--set train.num_threads=1")
set -euo pipefail
rounds=${1:-2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export LOOM_OFFLOAD_CPU_STORE=1
job=(--set train.model='"gpt"' --set train.max_steps=12 --set train.per_device_train_batch_size=4
     --set train.learning_rate=1e-3 --set train.max_grad_norm=0 --set train.save_strategy='"no"'
     --set train.logging_steps=1000 --set train.progress_bar=false --set train.log_level='"warn"'
     --set model.vocab_size=256 --set model.n_positions=128 --set model.n_embd=256
     --set model.n_layer=8 --set model.n_head=8 --set data.source='"random_tokens"'
     --set data.num_samples=256 --set data.seq_len=128 --set data.vocab_high=256 --set zero.stage=0)
printf '[train]\n[model]\n[data]\ntask = "lm"\n[zero]\n' >"$work/job.toml"
for round in $(seq "$rounds"); do
  for cfg in memory overlap after; do
    extra=()
    [ $cfg = overlap ] && extra=(--set 'zero.offload_optimizer={ device = "cpu" }')
    [ $cfg = after ] && extra=(--set 'zero.offload_optimizer={ device = "cpu", overlap_update = false }')
    build/bin/loom run "$work/job.toml" --set "train.output_dir=$work/$cfg-$round" "${job[@]}" ${LOOM_BENCH_SETS:-} \
      "${extra[@]}" >"$work/$cfg-$round.log" 2>&1 || { tail -3 "$work/$cfg-$round.log"; exit 1; }
    .venv/bin/python - "$work/$cfg-$round/metrics.jsonl" "$cfg" "$round" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
median = lambda key: statistics.median(x.get(key, 0.0) for x in lines[2:])
print(f"round {sys.argv[3]} {sys.argv[2]:8s} step {median('step_time_s'):.3f} s  "
      f"update waited {median('offload_update_s'):.4f} s  final loss {lines[-1]['loss']:.6f}")
PY
  done
done
