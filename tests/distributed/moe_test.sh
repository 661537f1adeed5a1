#!/usr/bin/env bash
# Expert parallelism with real processes (mpirun: mpi; loom-launch: gloo): a GPT whose blocks
# are 4-expert top-2 MoE layers, experts spread over 2 and 4 ranks (and 2 x 2: expert parallel
# within pairs, data parallel across them), ends after 10 steps (accumulation 2, every update
# clipped, an epoch boundary crossed: moe_job.toml says why 10) with
# the parameters of 1 process x batch N·b within 1e-6; a run resumed from its step-4
# checkpoint at the same world size is bitwise the uninterrupted one; the checkpoint holds
# every rank's experts (`loom consolidate` gives the whole (4, ...) expert tensors); a world
# size expert_parallel_size does not divide is a clear error. ZeRO stages 1-2 shard the dense
# parameters beside the placed experts to the same result; stage 3 with experts is refused, as
# is optimizer offload with experts.
# usage: moe_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
build=$1 src=$2 python=$3
loom=$build/bin/loom launch=$build/bin/loom-launch
job=$src/tests/distributed/moe_job.toml
work=$(mktemp -d)
trap cleanup_work EXIT  # testlib.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export LOOM_PLUGIN_PATH=$build/tests/plugins
# shellcheck source=testlib.sh
source "$src/tests/distributed/testlib.sh"
last=10 mid=4  # moe_job.toml's max_steps, and the step of the checkpoints resumed from
grep -q "^max_steps = $last$" "$job" || { echo "FAIL: moe_job.toml's max_steps is not $last"; exit 1; }

# The consolidated checkpoints hold every rank's experts: the whole (4, ...) expert tensors.
whole_experts() {
  local shape; shape=$("$python" "$src/tests/support/tensors.py" shape "$1.c$last.safetensors" h.0.ffn.w_in) &&
    { [ "${shape%%,*}" = 4 ] || { echo "h.0.ffn.w_in is ($shape), not 4 experts"; false; }; }
}

for case in "2 2 mpi" "4 4 mpi" "4 2 gloo" "2 2 gloo"; do
  read -r n ep backend <<<"$case"
  ref="$work/ref$n"
  [ -d "$ref" ] || ranks none 1 "$ref" --set "train.per_device_train_batch_size=$((2 * n))" ||
    { fail "reference for $n: $(tail -3 "$ref.log")"; continue; }
  out="$work/ep$ep-n$n-$backend" d=""
  if ranks "$backend" "$n" "$out" --set "moe.expert_parallel_size=$ep" &&
     d=$(same_params "$ref" "$out" 1e-6 $last) && whole_experts "$out"; then
    ok "experts over $ep of $n ranks ($backend) == 1 process x batch $((2 * n)) ($d)"
  else fail "ep $ep of $n ($backend): ${d:-} $(grep -v '^\s*$' "$out.log" | tail -4)"; fi
done

# Note [Partial model files]: with experts over ranks, model.safetensors lacks the experts
# and says so; the consolidated file has them all (whole_experts above).
partial=$("$python" "$src/tests/support/tensors.py" metadata "$work/ep2-n2-mpi/checkpoint-$last/model.safetensors" loom_partial)
[[ $partial == *"of the model's"*"loom consolidate"* ]] &&
  ok "the expert-parallel model.safetensors is marked partial (${partial:0:60}...)" ||
  fail "expert-parallel partial mark: '$partial'"

# Resume at the same world size: bitwise (the final checkpoints byte for byte, testlib.sh's
# same_checkpoint_files: one layout, so no `loom consolidate` of each). Balancing and z-losses
# on, capacity dropping too.
full=(--set moe.expert_parallel_size=2 --set moe.dropless=false --set moe.capacity_factor=1.0
      --set moe.aux_loss_coef=0.01 --set moe.z_loss_coef=0.001 --set train.save_steps=$mid)
if ranks mpi 2 "$work/whole" "${full[@]}" && cp -r "$work/whole" "$work/cut" &&
   rm -rf "$work/cut/checkpoint-$last" &&
   ranks mpi 2 "$work/cut" "${full[@]}" --set train.resume=latest &&
   d=$(same_checkpoint_files "$work/whole/checkpoint-$last" "$work/cut/checkpoint-$last"); then
  ok "expert-parallel run resumed from step $mid == the uninterrupted run ($d)"
else fail "resume: ${d:-} $(tail -3 "$work/cut.log")"; fi
# The same checkpoint resumed by one process (every expert on one rank): it trains on.
if ranks none 1 "$work/one" "${full[@]}" --set moe.expert_parallel_size=1 \
     --set "train.resume=$work/whole/checkpoint-$mid" --set train.per_device_train_batch_size=4; then
  ok "a 2-rank expert-parallel checkpoint resumes in one process"
else fail "resume on 1: $(tail -3 "$work/one.log")"; fi

expect_error "world size not divisible" "expert_parallel_size (2) must divide the world size (3" \
  timeout 120 mpirun --oversubscribe --bind-to none -np 3 "$loom" run "$job" \
  --set "train.output_dir=$work/bad3" --set moe.expert_parallel_size=2
# ZeRO stages 1-2 shard the dense parameters over all ranks while the experts stay placed
# (Note [ZeRO with placed parameters]): the same parameters as 1 process.
sed 's/^\[ddp\]/[zero]/' "$job" >"$work/zero.toml"
for case in "1 4 2 mpi" "2 4 2 gloo" "2 2 2 mpi"; do
  read -r stage n ep backend <<<"$case"
  out="$work/zero$stage-ep$ep-n$n-$backend" d=""
  if job="$work/zero.toml" ranks "$backend" "$n" "$out" --set "moe.expert_parallel_size=$ep" \
       --set "zero.stage=$stage" && d=$(same_params "$work/ref$n" "$out" 1e-6 $last); then
    ok "ZeRO stage $stage (dense) + experts over $ep of $n ranks ($backend) == 1 process ($d)"
  else fail "zero $stage ep $ep of $n ($backend): ${d:-} $(grep -v '^\s*$' "$out.log" | tail -4)"; fi
done
# Its checkpoint: the sharded dense state and the placed experts, resumed bitwise.
zfull=(--set moe.expert_parallel_size=2 --set zero.stage=2 --set train.save_steps=$mid)
if job="$work/zero.toml" ranks gloo 4 "$work/zwhole" "${zfull[@]}" && cp -r "$work/zwhole" "$work/zcut" &&
   rm -rf "$work/zcut/checkpoint-$last" &&
   job="$work/zero.toml" ranks gloo 4 "$work/zcut" "${zfull[@]}" --set train.resume=latest &&
   d=$(same_checkpoint_files "$work/zwhole/checkpoint-$last" "$work/zcut/checkpoint-$last"); then
  ok "ZeRO stage 2 + expert parallel run resumed from step $mid == the uninterrupted run ($d)"
else fail "zero resume: ${d:-} $(tail -3 "$work/zcut.log")"; fi
# Stage 3 refuses the placed experts; sharded_init, left out, was turned off for [moe] before,
# said in one line (not refused).
said="zero: [moe] replaces the units' feed-forward layers after the model is built: building the model whole before sharding it (sharded_init off)"
out=$(timeout 120 mpirun --oversubscribe --bind-to none -np 2 "$loom" run "$work/zero.toml" \
  --set "train.output_dir=$work/badzero" --set moe.expert_parallel_size=2 --set zero.stage=3 \
  --set 'train.log_level="info"' 2>&1)
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] &&
   grep -qF "use stage 1 or 2 with [moe] expert_parallel_size" <<<"$out" && grep -qF -- "$said" <<<"$out"; then
  ok "zero stage 3 with expert parallelism refused; sharded_init turned off for [moe] first"
else fail "zero stage 3 with expert parallelism (exit $rc): $(tail -3 <<<"$out")"; fi
# Optimizer offload keeps no placed state: refused with the key named, at stage 0 and 1.
for stage in 0 1; do
  expect_error "zero stage $stage offload with expert parallelism" \
    "offload_optimizer does not take parameters placed on some ranks only" \
    timeout 120 mpirun --oversubscribe --bind-to none -np 2 "$loom" run "$work/zero.toml" \
    --set "train.output_dir=$work/badoffload$stage" --set moe.expert_parallel_size=2 \
    --set zero.stage=$stage --set "zero.offload_optimizer={device=\"nvme\", nvme_path=\"$work/swap\"}"
done

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
