#!/usr/bin/env bash
# [train] optimizer_in_backward on 2 ranks (Note [Optimizer in backward]): ddp and zero stage 0
# free each .grad into its bucket and hand the bucket's averaged gradients to the update as it
# lands; after 6 steps the parameters are bitwise those of the normal step (clipping off in
# both), under mpirun (mpi) and loom-launch (gloo). ZeRO stage 2 updates each rank's chunk as
# its reduce-scatter lands (Note [Updating chunks in backward]): weights and every rank's
# optimizer state bitwise the normal stage-2 step's, and the zero plugin's measured model state
# matches its formula less the freed gradients. Stage 3, and Adafactor at stages 1-2, are
# refused by name by `loom check`.
# usage: optimizer_in_backward_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
# shellcheck source=testlib.sh
source "$(dirname "$0")/testlib.sh"
ranks_test_setup ddp_job.toml "$@"
mpirun=(mpirun --oversubscribe --bind-to none)
# The same job with [zero] stage = 0 in place of [ddp].
{ sed '/^\[ddp\]/,$d' "$job"; printf '[zero]\nstage = 0\nreduce_bucket_size = 20000\n'; } >"$work/zero0_job.toml"
sets=(--set train.max_grad_norm=0 --set train.max_steps=6)

# run2 BACKEND JOB OUT ARGS...: the job on 2 ranks.
run2() {
  local backend=$1 job_file=$2 out=$3; shift 3
  if [ "$backend" = mpi ]; then
    timeout 300 "${mpirun[@]}" -np 2 "$loom" run "$job_file" --set "train.output_dir=$out" \
      --set 'distributed.backend="mpi"' "$@" >"$out.log" 2>&1
  else
    port=$((port + 1))
    timeout 300 "$launch" --nproc-per-node 2 --master-port $port "$loom" run "$job_file" \
      --set "train.output_dir=$out" "$@" >"$out.log" 2>&1
  fi
}
for backend in mpi gloo; do
  for sync in ddp zero0; do
    sync_job=$job
    [ $sync = zero0 ] && sync_job=$work/zero0_job.toml
    name=$backend-$sync
    d=""
    if run2 $backend "$sync_job" "$work/$name-off" "${sets[@]}" &&
       run2 $backend "$sync_job" "$work/$name" "${sets[@]}" --set train.optimizer_in_backward=true &&
       d=$("$python" "$src/tests/support/tensors.py" compare "$work/$name-off/checkpoint-6/model.safetensors" \
           "$work/$name/checkpoint-6/model.safetensors" 0) && [[ $d == *bitwise* ]]; then
      ok "$backend, 2 ranks, $sync: optimizer_in_backward bitwise the normal step ($d)"
    else fail "$backend, 2 ranks, $sync: ${d:-} $(tail -n 3 "$work/$name.log" "$work/$name-off.log")"; fi
  done
done

# Stage 2 over groups of about one tensor, the shard accumulated over 2 micro-steps, the
# updated values' all-gathers capped below the model's size.
{ sed '/^\[ddp\]/,$d' "$job"
  printf '[zero]\nstage = 2\nreduce_bucket_size = 20000\nallgather_bucket_size = 30000\n'; } >"$work/zero2_job.toml"
name=gloo-zero2
d="" n=0
if run2 gloo "$work/zero2_job.toml" "$work/$name-off" "${sets[@]}" --set train.gradient_accumulation_steps=2 &&
   run2 gloo "$work/zero2_job.toml" "$work/$name" "${sets[@]}" --set train.gradient_accumulation_steps=2 \
     --set train.optimizer_in_backward=true; then
  for f in "$work/$name-off/checkpoint-6/"{model,optimizer-*}.safetensors; do
    d=$("$python" "$src/tests/support/tensors.py" compare "$f" "$work/$name/checkpoint-6/${f##*/}" 0) &&
      [[ $d == *bitwise* ]] && n=$((n + 1)) || { d="${f##*/}: $d"; break; }
  done
fi
if [ $n -eq 3 ]; then ok "gloo, 2 ranks, zero stage 2, accumulation 2: optimizer_in_backward bitwise the normal step (weights and both ranks' state)"
else fail "gloo, 2 ranks, zero stage 2: ${d:-} ($n of 3 files equal) $(tail -n 3 "$work/$name.log" "$work/$name-off.log")"; fi
# The zero plugin's model state after the first update (Note [Measured model state]) against
# the formula it prints: with optimizer_in_backward the formula leaves out the gradient shard,
# which was freed as its chunk updated (with it counted, about 8 Psi against 10 Psi: 0.8). A model of 0.8 M
# parameters, as zero_test.sh's memory check, so a batch's few kilobytes do not count.
out=$work/gloo-zero2-state
r=""
if run2 gloo "$work/zero2_job.toml" "$out" "${sets[@]}" --set train.max_steps=1 \
     --set model.n_embd=128 --set model.n_layer=4 --set train.optimizer_in_backward=true &&
   r=$("$python" -c "import json, sys; m = json.loads(open(sys.argv[1]).readline()); \
print(f\"{m['zero_model_state_measured_bytes'] / m['zero_model_state_formula_bytes']:.4f}\")" "$out/metrics.jsonl") &&
   "$python" -c "import sys; sys.exit(0 if abs($r - 1) <= 0.02 else 1)"; then
  ok "gloo, 2 ranks, zero stage 2, optimizer_in_backward: measured model state = $r x the formula less the freed gradients"
else fail "gloo, 2 ranks, zero stage 2, optimizer_in_backward: measured model state ${r:-?} x the formula $(tail -n 3 "$out.log")"; fi

{ sed '/^\[ddp\]/,$d' "$job"; printf '[zero]\nstage = 3\n'; } >"$work/zero3_job.toml"
expect_error "zero stage 3 with optimizer_in_backward is refused by name" \
  "[zero] stage 3 with [train] optimizer_in_backward is not built" \
  "$loom" check "$work/zero3_job.toml" "${sets[@]}" --set train.optimizer_in_backward=true
# Adafactor's whole-tensor sums at stages 1-2: refused by `loom check`, from the job, before the
# rule meets a driver (the job's adamw eps is not one of adafactor's keys).
{ sed -e '/^\[ddp\]/,$d' -e '/^eps = /d' "$job"; printf '[zero]\nstage = 1\n'; } >"$work/zero1_job.toml"
expect_error "zero stage 1 with optimizer_in_backward and adafactor is refused by loom check" \
  "optimizer_in_backward at [zero] stage 1 (" \
  "$loom" check "$work/zero1_job.toml" "${sets[@]}" --set train.optimizer_in_backward=true \
  --set 'optimizer.name="adafactor"'

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
