#!/usr/bin/env bash
# Note [Overlapped update] (offload/include/loom/offload/offloaded_driver.h) on 2 ranks under
# mpirun: [zero] stage 0 with offload_optimizer.device = "cpu" in its CPU twin
# (LOOM_OFFLOAD_CPU_STORE=1) hands each bucket's averaged gradients to the host store as the
# bucket is waited for; after 6 steps the weights are bitwise the in-memory stage 0 run's, for
# adamw in fp32 without clipping (every tensor's update started before update(): the
# offload_updated_in_backward metric), adafactor in bf16 with clipping (none started early: the
# update waits for the norm), adam8bit in bf16 without clipping, and adamw in bf16 without fp32
# masters ([optimizer] master_dtype = "bf16": Note [Offloaded without masters], each tensor's
# bf16 weights rounded into where they are as its averaged gradient lands).
# usage: offload_overlap_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
# shellcheck source=testlib.sh
source "$(dirname "$0")/testlib.sh"
ranks_test_setup ddp_job.toml "$@"
# [optimizer] eps is adam's (set below for the adam rules): adafactor has eps1 and eps2.
{ sed -e '/^\[ddp\]/,$d' -e '/^eps = /d' "$job"; printf '[zero]\nstage = 0\nreduce_bucket_size = 20000\n'; } >"$work/zero0.toml"
# The tiny GPT's trainable tensors: 2 embeddings, 12 per block, the final norm's 2.
tensors=28

# run2 OUT ARGS...: the stage-0 job on 2 ranks, 6 steps, saved at the end.
run2() {
  local out=$1; shift
  timeout 120 mpirun --oversubscribe --bind-to none -x LOOM_PLUGIN_PATH -x LOOM_OFFLOAD_CPU_STORE \
    -np 2 "$loom" run "$work/zero0.toml" --set "train.output_dir=$out" --set train.max_steps=6 \
    --set 'distributed.backend="mpi"' "$@" >"$out.log" 2>&1
}
# early_counts OUT: the distinct offload_updated_in_backward values of rank 0's metrics.
early_counts() {
  "$python" -c 'import json,sys
print(" ".join(sorted({str(int(json.loads(l)["offload_updated_in_backward"])) for l in open(sys.argv[1])})))' \
    "$1/metrics.jsonl"
}
export LOOM_OFFLOAD_CPU_STORE=1
host=(--set 'zero.offload_optimizer={ device = "cpu" }')
for case in "adamw fp32 0" "adafactor full_bf16 1.0" "adam8bit full_bf16 0" "adamw full_bf16 0 bf16"; do
  read -r rule mode clip masters <<<"$case"
  sets=(--set "optimizer.name=\"$rule\"" --set "train.max_grad_norm=$clip")
  [ -n "$masters" ] && sets+=(--set "optimizer.master_dtype=\"$masters\"")
  [ "$rule" != adafactor ] && sets+=(--set optimizer.eps=1e-5)
  [ "$rule" = adam8bit ] && sets+=(--set optimizer.block_size=64 --set optimizer.min_8bit_size=256)
  [ "$mode" != fp32 ] && sets+=(--set "precision.mode=\"$mode\"")
  name=$rule-$mode${masters:+-masters-$masters}
  expected=$tensors
  [ "$clip" != 0 ] && expected=0
  d="" counts=""
  if run2 "$work/$name-memory" "${sets[@]}" && run2 "$work/$name-host" "${sets[@]}" "${host[@]}" &&
     counts=$(early_counts "$work/$name-host") && [ "$counts" = "$expected" ] &&
     d=$("$python" "$src/tests/support/tensors.py" compare "$work/$name-memory/checkpoint-6/model.safetensors" \
         "$work/$name-host/checkpoint-6/model.safetensors" 0) && [[ $d == *bitwise* ]]; then
    ok "2 ranks, $rule, $mode${masters:+ (master_dtype $masters)}, max_grad_norm $clip: overlapped host store bitwise in memory ($d; $counts tensors updated during backward)"
  else fail "2 ranks, $rule, $mode, max_grad_norm $clip: ${d:-} updated early: '${counts:-}' (expected $expected) $(tail -n 3 "$work/$name-host.log" "$work/$name-memory.log")"; fi
done

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
