#!/usr/bin/env bash
# Sharded initialization at ZeRO stage 3 (Note [Sharded initialization] in loom/nn.h), with real
# ranks (loom-launch, gloo): a model built a unit at a time, each cut to the rank's chunk as it
# is initialised, trains bitwise as the model built whole and then sharded ([zero]
# sharded_init = false): the initial weights (learning rate 0) and the weights after 1 and 2
# steps, for gpt's random initialisation (adamw; adafactor's row cuts with bf16 weights; shard
# groups of 1) and for from_pretrained folders transformers wrote (gpt's transposed Conv1D
# weights read in part from the mapped file; llama, whose initial weights are also the file's
# own, checked against it); with both offloads and activation checkpointing. Plugins that change
# the units after the build turn it off when it is left out, and are refused by name with
# sharded_init = true.
# usage: sharded_init_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
# shellcheck source=testlib.sh
source "$2/tests/distributed/testlib.sh"
ranks_test_setup zero_job.toml "$@"

weights() {  # RUN STEP: RUN.cSTEP.safetensors, the consolidated model of checkpoint-STEP
  "$loom" consolidate "$1/checkpoint-$2" "$1.c$2.safetensors" >/dev/null
}
# The two runs of a pair keep their state in the same layout (2 ranks, stage 3), so their
# checkpoints are compared file by file (testlib.sh's same_checkpoint_files: the weights'
# pieces and the optimizer state byte for byte): what consolidating both and comparing the
# models checked, and more, without the 2 loom processes per step compared (20 in all).
bitwise() {  # A B STEP: the two runs' checkpoint-STEP, byte for byte
  same_checkpoint_files "$1/checkpoint-$3" "$2/checkpoint-$3"
}
# pair NAME SETS...: the job with sharded_init on and off, saving every step.
pair() {
  local name=$1; shift
  ranks gloo 2 "$work/$name-on" --set zero.stage=3 --set train.save_steps=1 --set train.log_level='"info"' "$@" &&
    ranks gloo 2 "$work/$name-off" --set zero.stage=3 --set train.save_steps=1 --set zero.sharded_init=false "$@"
}
check_pair() {  # NAME STEPS...
  local name=$1 d step; shift
  if ! grep -q "built a unit at a time (sharded initialization)" "$work/$name-on.log"; then
    fail "$name: the sharded run did not build a unit at a time: $(tail -3 "$work/$name-on.log")"; return; fi
  if grep -q "sharded initialization" "$work/$name-off.log"; then
    fail "$name: sharded_init = false still built a unit at a time"; return; fi
  for step in "$@"; do
    if d=$(bitwise "$work/$name-on" "$work/$name-off" "$step"); then
      ok "$name: sharded init == built whole, step $step ($d)"
    else fail "$name, step $step: ${d:-} $(tail -3 "$work/$name-on.log")"; fi
  done
}

common=(--set train.max_steps=2)
adamw=(--set optimizer.eps=1e-5)
# --- random initialisation: learning rate 0 keeps the initial weights through the update.
pair gpt-init "${common[@]}" "${adamw[@]}" --set train.max_steps=1 --set train.learning_rate=0 &&
  check_pair gpt-init 1 || fail "gpt-init runs: $(tail -3 "$work/gpt-init-on.log" "$work/gpt-init-off.log")"
pair gpt "${common[@]}" "${adamw[@]}" && check_pair gpt 1 2 || fail "gpt runs: $(tail -3 "$work/gpt-off.log")"
# Adafactor cuts at rows (the observer cuts as the driver does); bf16 weights (the precision
# plugin changes a released weight's dtype only; the driver casts the chunk).
pair adafactor-bf16 "${common[@]}" --set optimizer.name=adafactor --set optimizer.eps1=1e-10 \
  --set 'precision.mode="full_bf16"' && check_pair adafactor-bf16 2 ||
  fail "adafactor-bf16 runs: $(tail -3 "$work/adafactor-bf16-off.log")"
pair groups-of-1 "${common[@]}" "${adamw[@]}" --set zero.shard_group_size=1 && check_pair groups-of-1 2 ||
  fail "groups-of-1 runs: $(tail -3 "$work/groups-of-1-off.log")"
# Both offloads start from the chunks: the weight shards and the optimizer state on "NVMe"
# (a folder here), and activation checkpointing's recompute gathers the cut units again.
mkdir -p "$work/nvme"
pair offload "${common[@]}" "${adamw[@]}" --set 'precision.mode="full_bf16"' \
  --set "zero.offload_param={device=\"nvme\", nvme_path=\"$work/nvme\"}" \
  --set "zero.offload_optimizer={device=\"nvme\", nvme_path=\"$work/nvme\"}" \
  --set checkpointing.every=1 && check_pair offload 2 || fail "offload runs: $(tail -3 "$work/offload-off.log")"

# --- from_pretrained: tiny folders transformers wrote (examples/tiny_models.py).
"$python" "$src/examples/tiny_models.py" --only gpt2 --only llama "$work/models" >/dev/null 2>&1 ||
  fail "examples/tiny_models.py could not write the model folders"
pretrained_job() {  # MODEL FOLDER: a job for it (its shape from config.json)
  cat <<TOML
[train]
model = "$1"
per_device_train_batch_size = 2
learning_rate = 1e-3
seed = 5
progress_bar = false
log_level = "warn"

[model]
from_pretrained = "$2"
$( [ "$1" = gpt ] && echo 'dropout = 0.0' )

[data]
source = "random_tokens"
task = "lm"
num_samples = 64
seq_len = 16
vocab_low = 0
vocab_high = 64

[optimizer]
name = "adamw"

[distributed]
timeout_seconds = 60

[zero]
stage = 3
reduce_bucket_size = 20000
stage3_param_persistence_threshold = 0
TOML
}
pretrained_job gpt "$work/models/my-gpt2" >"$work/gpt2.toml"
pretrained_job llama "$work/models/my-llama" >"$work/llama.toml"
job=$work/gpt2.toml pair hf-gpt2 "${common[@]}" "${adamw[@]}" && check_pair hf-gpt2 1 2 ||
  fail "hf-gpt2 runs: $(tail -3 "$work/hf-gpt2-off.log")"
job=$work/llama.toml pair hf-llama "${common[@]}" "${adamw[@]}" && check_pair hf-llama 1 2 ||
  fail "hf-llama runs: $(tail -3 "$work/hf-llama-off.log")"
# llama's names are transformers' own: at learning rate 0 the sharded run's weights are the
# file's, bit for bit.
if job=$work/llama.toml ranks gloo 2 "$work/hf-llama-lr0" --set zero.stage=3 \
     --set train.max_steps=1 --set train.learning_rate=0 && weights "$work/hf-llama-lr0" 1 &&
   d=$("$python" "$src/tests/support/tensors.py" compare "$work/hf-llama-lr0.c1.safetensors" \
       "$work/models/my-llama/model.safetensors" 0) && [[ $d == *bitwise* ]]; then
  ok "hf-llama: sharded init's weights are the pretrained file's ($d)"
else fail "hf-llama vs its file: ${d:-} $(tail -3 "$work/hf-llama-lr0.log")"; fi

# --- refusals, by name
expect_error "lora with sharded_init = true" "[zero] sharded_init = true cuts each unit to this rank's part as it is built, but [lora] freezes the units' weights and adds adapters to them after the model is built, which needs the whole model; set [zero] sharded_init = false, or leave it out" \
  "$loom" check "$src/tests/distributed/zero_job.toml" --set zero.stage=3 --set lora.r=4 --set 'lora.target_modules=["qkv"]' --set zero.sharded_init=true
# Left out, it is turned off for such a job (zero_test.sh's and moe_test.sh's runs say so).
if out=$("$loom" check "$src/tests/distributed/zero_job.toml" --set zero.stage=3 --set lora.r=4 \
     --set 'lora.target_modules=["qkv"]' 2>&1); then
  ok "lora at stage 3 with sharded_init left out: checked ok"
else fail "lora at stage 3 with sharded_init left out: $(tail -3 <<<"$out")"; fi
expect_error "sharded_init at stage 2" "[zero] sharded_init = true cuts the units' weights as the model is built, which stage 3 alone shards; set stage = 3 or remove sharded_init" \
  "$loom" check "$src/tests/distributed/zero_job.toml" --set zero.stage=2 --set zero.sharded_init=true

echo "passed $passed, failed $failed"
[ "$failed" -eq 0 ]
