#!/usr/bin/env bash
# ZeRO stages 1-3 with real processes (mpirun: mpi; loom-launch: gloo; plain processes given
# Slurm's variables): N ranks with batch b end with the parameters of 1 process with batch N*b
# (10 steps, accumulation 2, clipping at every step, an epoch boundary crossed at N = 2 and 4),
# for adamw, adafactor and adam8bit at N = 1, 2, 4 and sgd
# and lion at N = 2; bf16 weights (fp32 masters sharded), fp16 with the loss scaler, activation
# checkpointing and LoRA under stage 3 equal plain data parallelism; evaluation under stage 3
# changes no weight and its eval_loss is one process's; the communication volume
# per step; a 4-rank stage-3 checkpoint resumes on 2 and 3 ranks (weights and optimizer state
# resharded) to the uninterrupted run's parameters, and `loom consolidate` of it is the
# single-process model in a file Python reads; a missing or foreign shard, bad [zero] keys and
# stage 3 without units are clear errors; optimizer state offloaded to NVMe at stages 0-3, and
# stage 3's weight shards too (on NVMe; in host memory as a GPU run's CPU twin), are bitwise the
# in-memory runs; auto_find_batch_size agrees over
# ranks; checkpoints saved in the background (async_save) at stage 3 on 2 ranks are the
# synchronous run's, byte for byte. Parameters are compared through `loom consolidate` (stage 3 checkpoints hold no whole
# weights; bf16 runs compare their fp32 masters), or, between two runs of one layout that must be
# bitwise alike, as their checkpoints' files byte for byte.
# usage: zero_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
build=$1 src=$2 python=$3
loom=$build/bin/loom launch=$build/bin/loom-launch
work=$(mktemp -d)
trap cleanup_work EXIT  # testlib.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export LOOM_PLUGIN_PATH=$build/tests/plugins
# shellcheck source=testlib.sh
source "$src/tests/distributed/testlib.sh"

# The runs are zero_job.toml cut to 10 steps: ~100 runs of up to 4 ranks on a 2-core machine
# made its 20 steps the bulk of the suite's time, and 10 still show what 20 did. The gradient
# norm stays above max_grad_norm 0.5 at every step (checked below), so every update is clipped,
# with accumulation 2. The job's 64 samples make the runs cross an epoch boundary (at step 8 on
# N = 2, 8 samples a step; at 4 and 8 on N = 4, 16 a step); the resharded runs (12 a step)
# resume from checkpoint-4, 12 of each rank's 16 samples into the first epoch, and go through
# that epoch's short last batch and the boundary on their new world size, as the 20-step runs
# did from checkpoint-10. Checkpoints are saved every $mid steps where a case needs them, and
# every comparison is of checkpoint-$last.
last=10 mid=4
job=$work/zero_job.toml
sed -e "s/^max_steps = 20$/max_steps = $last/" "$src/tests/distributed/zero_job.toml" >"$job"
grep -q "^max_steps = $last$" "$job" ||
  { echo "FAIL: zero_job.toml no longer says max_steps = 20; update zero_test.sh"; exit 1; }
same_params() {  # A B TOLERANCE [STEP]: testlib.sh's (whole fp32 models linked, not
  # consolidated), of checkpoint-$last unless told
  consolidated "$1" "${4:-$last}" && consolidated "$2" "${4:-$last}" &&
  "$python" "$src/tests/support/tensors.py" compare "$1.c${4:-$last}.safetensors" "$2.c${4:-$last}.safetensors" "$3"
}

declare -A rule_sets=(
  [adamw]="--set optimizer.eps=1e-5 --set train.save_steps=$mid"
  [adafactor]="--set optimizer.name=adafactor --set optimizer.eps1=1e-10"
  [adam8bit]="--set optimizer.name=adam8bit --set optimizer.eps=1e-5 --set optimizer.block_size=64 --set optimizer.min_8bit_size=256"
  [sgd]="--set optimizer.name=sgd --set optimizer.momentum=0.9"
  [lion]="--set optimizer.name=lion --set train.learning_rate=1e-4"
)
# --- N ranks x batch 2 == 1 process x batch 2N, stages 1 and 2
# Adafactor divides by sqrt(g^2 + eps1): eps1 1e-10 keeps last-bit noise in gradients that are
# zero in exact arithmetic (the key bias of attention) from becoming full-size updates, as eps
# does for adamw (ddp_job.toml). 8-bit state cannot be held to 1e-6 against one process: a
# last-bit gradient difference (the batch split alone makes one, in DDP too) moves a value
# across a quantization code, so adam8bit is held to 2e-3 there (what DDP itself reaches) and
# to bit-equality with DDP (stage 0) at the same world size, where the sums are the same.
check_rule() {  # RULE SIZES...
  local rule=$1; shift
  local tolerance=1e-6
  [ "$rule" = adam8bit ] && tolerance=2e-3
  # shellcheck disable=SC2086
  local sets=(${rule_sets[$rule]})
  for n in "$@"; do
    ranks none 1 "$work/$rule-ref$n" "${sets[@]}" --set zero.stage=0 \
      --set "train.per_device_train_batch_size=$((2 * n))" ||
      { fail "$rule reference for $n: $(tail -3 "$work/$rule-ref$n.log")"; continue; }
    for stage in 1 2 3; do
      local backend=mpi
      [ $stage -eq 2 ] && backend=gloo
      [ $stage -eq 3 ] && [ "$n" -eq 4 ] && backend=gloo
      local out="$work/$rule-s$stage-n$n" d=""
      if ranks $backend "$n" "$out" "${sets[@]}" --set zero.stage=$stage &&
         d=$(same_params "$work/$rule-ref$n" "$out" $tolerance); then
        ok "$rule, stage $stage, $n rank(s) over $backend == 1 process x batch $((2 * n)) ($d)"
      else fail "$rule stage $stage $n ranks ($backend): ${d:-} $(grep -v '^\s*$' "$out.log" | tail -4)"; fi
    done
  done
}
check_rule adamw 1 2 4
check_rule adafactor 1 2 4
check_rule adam8bit 1 2 4
for n in 2 4; do  # stage 1 sums like DDP: bitwise, 8-bit state and all
  sets=(${rule_sets[adam8bit]})
  if ranks mpi $n "$work/adam8bit-s0-n$n" "${sets[@]}" --set zero.stage=0 &&
     d=$(same_params "$work/adam8bit-s0-n$n" "$work/adam8bit-s1-n$n" 0); then
    ok "adam8bit, stage 1 == stage 0 (DDP) on $n ranks ($d)"
  else fail "adam8bit stage 1 vs 0 on $n: ${d:-} $(tail -3 "$work/adam8bit-s0-n$n.log")"; fi
done
check_rule sgd 2
check_rule lion 2
# What the 8 steps must keep: every update of those references was clipped (grad_norm is the
# norm before clipping).
low=$("$python" - "$work"/*-ref*/metrics.jsonl <<'PY'
import json, sys
print(f"{min(json.loads(l)['grad_norm'] for f in sys.argv[1:] for l in open(f)):.3f}")
PY
)
"$python" -c "import sys; sys.exit(0 if float(sys.argv[1]) > 0.5 else 1)" "${low:-0}" &&
  ok "every step of the 11 references clipped (smallest grad_norm $low > max_grad_norm 0.5)" ||
  fail "a reference step not clipped: smallest grad_norm ${low:-?}"
# The other backend for each stage once.
ranks gloo 2 "$work/adamw-s1-gloo" --set optimizer.eps=1e-5 --set zero.stage=1 &&
  d=$(same_params "$work/adamw-ref2" "$work/adamw-s1-gloo" 1e-6) &&
  ok "adamw, stage 1, 2 ranks over gloo ($d)" || fail "stage 1 gloo: $(tail -3 "$work/adamw-s1-gloo.log")"
ranks mpi 2 "$work/adamw-s2-mpi" --set optimizer.eps=1e-5 --set zero.stage=2 &&
  d=$(same_params "$work/adamw-ref2" "$work/adamw-s2-mpi" 1e-6) &&
  ok "adamw, stage 2, 2 ranks over mpi ($d)" || fail "stage 2 mpi: $(tail -3 "$work/adamw-s2-mpi.log")"

# --- Note [Asynchronous checkpoints] on 2 ranks at stage 3 (each rank writes its optimizer
# shard on its writer thread; the commit rides on a step's loss all-reduce): checkpoint-4,
# written in the background, and the final checkpoint-10 are byte-identical (cmp, every file
# but the manifest, whose job text names another output_dir) to the synchronous run's, and the
# manifests agree but for that.
same_checkpoints() {  # A B STEP...: every file byte-identical but manifest.json, compared as JSON
  local a=$1 b=$2 c f; shift 2
  for c in "$@"; do
    [ "$(ls "$a/checkpoint-$c")" = "$(ls "$b/checkpoint-$c")" ] &&
      [ "$(ls "$b/checkpoint-$c" | grep -c 'optimizer-0000[01]-of-00002')" -eq 2 ] || return 1
    for f in "$a/checkpoint-$c"/*.safetensors; do cmp "$f" "$b/checkpoint-$c/${f##*/}" || return 1; done
    "$python" - "$a/checkpoint-$c/manifest.json" "$b/checkpoint-$c/manifest.json" <<'PY' || return 1
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
for m in (a, b):
    del m["job"], m["manifest_crc32"]
sys.exit(a != b)
PY
  done
}
if ranks mpi 2 "$work/async-s3" --set optimizer.eps=1e-5 --set train.save_steps=$mid --set zero.stage=3 \
     --set train.async_save=true --set train.log_level=info &&
   grep -q "saved checkpoint $work/async-s3/checkpoint-$mid (in the background" "$work/async-s3.log" &&
   same_checkpoints "$work/adamw-s3-n2" "$work/async-s3" $mid $last; then
  ok "async_save, stage 3 on 2 ranks: checkpoints $mid (background) and $last byte-identical to the synchronous run's"
else fail "async_save stage 3: $(grep -v '^\s*$' "$work/async-s3.log" | tail -3)"; fi

# --- bf16 weights: sharded fp32 masters train exactly like the replicated ones (stage 0).
# Stages 2 and 3 accumulate each micro-step's reduced gradient in a bf16 shard where stage 0
# accumulates before reducing, so they are compared without accumulation.
bf16=(--set optimizer.eps=1e-5 --set 'precision.mode="full_bf16"')
for stage in 1 2 3; do
  acc=2; [ $stage -ge 2 ] && acc=1
  backend=mpi; [ $stage -eq 3 ] && backend=gloo  # half weights travel over both
  if { [ -d "$work/bf16-s0-a$acc" ] || ranks mpi 2 "$work/bf16-s0-a$acc" "${bf16[@]}" --set zero.stage=0 --set train.gradient_accumulation_steps=$acc; } &&
     ranks $backend 2 "$work/bf16-s$stage" "${bf16[@]}" --set zero.stage=$stage --set train.gradient_accumulation_steps=$acc &&
     d=$(same_params "$work/bf16-s0-a$acc" "$work/bf16-s$stage" 1e-6); then
    ok "bf16 weights, stage $stage == stage 0 on 2 ranks ($backend), accumulation $acc ($d)"
  else fail "bf16 stage $stage: ${d:-} $(tail -3 "$work/bf16-s$stage.log")"; fi
done
# --- Note [ZeRO without masters]: master_dtype = "bf16" keeps no fp32 masters at any stage; the
# weights' stochastic rounding is keyed by name and element index, so stages 1-3 on 2 ranks write
# stage 0's bits (the core's driver), with no master in any optimizer shard. A stage-2 run
# resumed from checkpoint-$mid ends bitwise where it ended; resumed with fp32 masters it starts
# them from the weights, and a masters checkpoint resumed without them drops them (warned): both
# end within 2e-2 of the run that never switched (rounding apart; masters lost would be ~1).
nm=("${bf16[@]}" --set 'optimizer.master_dtype="bf16"' --set train.gradient_accumulation_steps=1)
ranks mpi 2 "$work/nm-s0" "${nm[@]}" --set zero.stage=0 || fail "no masters, stage 0: $(tail -3 "$work/nm-s0.log")"
for stage in 1 2 3; do
  backend=mpi; [ $stage -eq 3 ] && backend=gloo
  if ranks $backend 2 "$work/nm-s$stage" "${nm[@]}" --set zero.stage=$stage --set train.save_steps=$mid &&
     d=$(same_params "$work/nm-s0" "$work/nm-s$stage" 0) &&
     ! for shard in "$work/nm-s$stage/checkpoint-$last"/optimizer-*.safetensors; do
         safetensors_header "$shard"; done | grep -q 'master/'; then
    ok "no masters (master_dtype = bf16), stage $stage == stage 0 on 2 ranks ($backend), bit for bit ($d)"
  else fail "no masters stage $stage: ${d:-} $(grep -v '^\s*$' "$work/nm-s$stage.log" | tail -3)"; fi
done
mkdir -p "$work/nm-resume" && cp -r "$work/nm-s2/checkpoint-$mid" "$work/nm-resume/"
if ranks mpi 2 "$work/nm-resume" "${nm[@]}" --set zero.stage=2 --set train.resume=latest &&
   d=$(same_params "$work/nm-s2" "$work/nm-resume" 0); then
  ok "no masters, stage 2: resumed from checkpoint-$mid == the uninterrupted run, bit for bit ($d)"
else fail "no masters resume: ${d:-} $(grep -v '^\s*$' "$work/nm-resume.log" | tail -3)"; fi
mkdir -p "$work/nm-widen" && cp -r "$work/nm-s2/checkpoint-$mid" "$work/nm-widen/"
if ranks mpi 2 "$work/nm-widen" "${bf16[@]}" --set train.gradient_accumulation_steps=1 --set zero.stage=3 \
     --set train.resume=latest --set train.save_steps=8 &&
   grep -q 'holds no fp32 masters' "$work/nm-widen.log" &&
   for shard in "$work/nm-widen/checkpoint-$last"/optimizer-*.safetensors; do
     safetensors_header "$shard"; done | grep -q 'master/' &&
   d=$(same_params "$work/nm-s2" "$work/nm-widen" 2e-2); then
  ok "a no-masters checkpoint resumed at stage 3 with fp32 masters: masters start from the weights (warned; $d)"
else fail "no masters -> masters: ${d:-} $(grep -v '^\s*$' "$work/nm-widen.log" | tail -3)"; fi
mkdir -p "$work/nm-drop" && cp -r "$work/nm-widen/checkpoint-8" "$work/nm-drop/"
if ranks mpi 2 "$work/nm-drop" "${nm[@]}" --set zero.stage=1 --set train.resume=latest &&
   grep -q 'holds fp32 masters' "$work/nm-drop.log" &&
   d=$(same_params "$work/nm-s2" "$work/nm-drop" 2e-2); then
  ok "a masters checkpoint resumed at stage 1 without them: masters dropped (warned; $d)"
else fail "masters -> no masters: ${d:-} $(grep -v '^\s*$' "$work/nm-drop.log" | tail -3)"; fi
# --- stage 3 composes: fp16 with the loss scaler, activation checkpointing (the recompute
# gathers the unit again), LoRA (only the adapters are trainable, so only they are sharded).
# Without accumulation, as for bf16: the sums are then DDP's, bit for bit.
compose() {  # NAME SETS...
  local name=$1; shift
  local one=(--set optimizer.eps=1e-5 --set train.gradient_accumulation_steps=1)
  if ranks gloo 2 "$work/$name-s0" "${one[@]}" --set zero.stage=0 "$@" &&
     ranks gloo 2 "$work/$name-s3" "${one[@]}" --set zero.stage=3 "$@" &&
     d=$(same_params "$work/$name-s0" "$work/$name-s3" 1e-6); then
    ok "stage 3 with $name == stage 0 on 2 ranks ($d)"
  else fail "stage 3 with $name: ${d:-} $(grep -v '^\s*$' "$work/$name-s3.log" | tail -3)"; fi
}
compose fp16 --set 'precision.mode="fp16"' --set 'train.log_level="info"'
# Note [Freed weights go back]: stage 3 returns freed blocks by default; the key keeps them.
compose checkpointing --set checkpointing.every=1 --set zero.stage3_return_freed_memory=false \
  --set 'train.log_level="info"'
if grep -q "zero: stage 3 on the CPU: blocks of 1 MiB and more are returned to the system" "$work/fp16-s3.log" &&
   grep -q "zero: stage 3 on the CPU: freed blocks stay in malloc's heap for the next step" "$work/checkpointing-s3.log" &&
   ! grep -q "blocks of 1 MiB and more are returned" "$work/checkpointing-s3.log"; then
  ok "stage 3 returns freed blocks to the system unless stage3_return_freed_memory = false"
else fail "stage3_return_freed_memory: $(grep -h 'zero: stage 3 on the CPU' "$work/fp16-s3.log" "$work/checkpointing-s3.log")"; fi
# LoRA changes the units once the model is built: with sharded_init left out, stage 3 builds
# it whole first and says so in one line (sharded_init_test.sh checks that sharded_init = true
# is refused).
compose lora --set lora.r=4 --set 'lora.target_modules=["qkv","fc_in"]' --set 'train.log_level="info"'
said="zero: [lora] freezes the units' weights and adds adapters to them after the model is built: building the model whole before sharding it (sharded_init off)"
if [ "$(grep -cF -- "$said" "$work/lora-s3.log")" -eq 1 ]; then
  ok "stage 3 with lora: sharded_init left out is turned off, said once"
else fail "stage 3 with lora: no single line '$said': $(grep zero: "$work/lora-s3.log" | head -3)"; fi

# --- Note [Evaluation] under stage 3: every rank gathers each unit for the evaluation's
# forwards together (7 samples on 2 ranks in batches of 2: one rank's last batch is a filler).
# Evaluating changes no weight (bitwise the same run without), and the step-0 eval_loss of 2
# ranks is one process's (sums, not means of means).
eval_job=$work/eval_job.toml
{ cat "$job"; printf '\n[eval_data]\nnum_samples = 7\nseq_len = 16\nvocab_low = 0\nvocab_high = 64\ntask = "lm"\n'; } >"$eval_job"
evaluating=(--set 'train.eval_strategy="steps"' --set train.eval_steps=2 --set train.eval_on_start=true
            --set train.per_device_eval_batch_size=2)
first_eval_loss() { "$python" -c "import json,sys; print(next(json.loads(l)['eval_loss'] for l in open(sys.argv[1]) if 'eval_loss' in l))" "$1/metrics.jsonl"; }
if job=$eval_job ranks mpi 2 "$work/eval-s3" --set optimizer.eps=1e-5 --set zero.stage=3 "${evaluating[@]}" &&
   d=$(same_checkpoint_files "$work/adamw-s3-n2/checkpoint-$last" "$work/eval-s3/checkpoint-$last") &&
   [ "$(grep -c eval_loss "$work/eval-s3/metrics.jsonl")" -eq 6 ]; then
  ok "stage 3 on 2 ranks evaluating at steps 0, 2, 4, 6, 8, 10 == the same run without ($d)"
else fail "stage 3 with evaluation: ${d:-} $(grep -v '^\s*$' "$work/eval-s3.log" | tail -3)"; fi
if job=$eval_job ranks none 1 "$work/eval-one" --set train.max_steps=0 "${evaluating[@]}" &&
   "$python" -c "import sys; a, b = map(float, sys.argv[1:]); sys.exit(abs(a - b) > 1e-6 * abs(a))" \
     "$(first_eval_loss "$work/eval-one")" "$(first_eval_loss "$work/eval-s3")"; then
  ok "step-0 eval_loss on 2 ranks (stage 3) == 1 process's ($(first_eval_loss "$work/eval-s3"))"
else fail "eval_loss over ranks: $(first_eval_loss "$work/eval-one" 2>&1) vs $(first_eval_loss "$work/eval-s3" 2>&1)"; fi

# --- communication per step: reduce-scatter + all-gather of the padded flat groups (2 Psi at
# stage 1; stage 2 reduce-scatters each of the 2 micro-steps: 3 Psi).
volume() {  # DIR: zero_comm_elements of step 1 / trainable parameters
  "$python" - "$1" <<'PY'
import json, sys
run = json.load(open(sys.argv[1] + "/run.json"))
step = json.loads(open(sys.argv[1] + "/metrics.jsonl").readline())
print(f"{step['zero_comm_elements'] / run['model_state']['trainable_params']:.4f}")
PY
}
# Stage 3 also gathers each unit's weights for forward and again for backward (2 x the units'
# share, Psi_u); embeddings and the final norm stay whole and are all-gathered once, as at 2.
units_share() {  # DIR STEP: the units' share of the trainable parameters
  "$python" - "$1" "$2" <<'PY'
import json, sys
from safetensors import safe_open
run = json.load(open(sys.argv[1] + "/run.json"))
with safe_open(sys.argv[1] + ".c" + sys.argv[2] + ".safetensors", "np") as f:
    units = sum(f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape()[1] if len(f.get_slice(k).get_shape()) > 1 else 1) for k in f.keys() if k.startswith("h."))
print(units / run["model_state"]["trainable_params"])
PY
}
for stage in 1 2 3; do
  want=$((stage + 1))
  # 2 micro-steps at stage 3: 2 reduce-scatters (2 Psi), the whole-kept rest all-gathered once
  # ((1 - u) Psi), each unit gathered for forward and for backward in each (4 u Psi).
  [ $stage -eq 3 ] && want=$("$python" -c "u = $(units_share "$work/adamw-s3-n4" $last); print(round(3 + 3 * u, 4))")
  v=$(volume "$work/adamw-s$stage-n4")
  if "$python" -c "import sys; sys.exit(0 if abs($v - $want) <= 0.02 * $want else 1)"; then
    ok "stage $stage, 4 ranks, accumulation 2: $v x Psi elements per rank per step (want $want Psi)"
  else fail "stage $stage communication volume $v Psi, want $want Psi"; fi
done

# --- model-state bytes per rank: the memory tracker after the first update against ZeRO's
# formula (a model of 0.8 M parameters, so a batch's few kilobytes do not count)
memory() {  # DIR: measured / formula on rank 0
  "$python" - "$1/metrics.jsonl" <<'PY'
import json, sys
m = json.loads(open(sys.argv[1]).readline())
print(f"{m['zero_model_state_measured_bytes'] / m['zero_model_state_formula_bytes']:.4f}")
PY
}
for n in 2 4; do
  for stage in 1 2 3; do
    for mode in fp32 full_bf16; do
      [ $mode = full_bf16 ] && [ $stage -ne 2 ] && continue
      out="$work/mem-$mode-s$stage-n$n"
      if ranks mpi $n "$out" --set zero.stage=$stage --set train.max_steps=1 --set model.n_embd=128 \
           --set model.n_layer=4 --set "precision.mode=\"$mode\"" --set train.log_level=info && r=$(memory "$out") &&
         "$python" -c "import sys; sys.exit(0 if abs($r - 1) <= 0.02 else 1)"; then
        ok "stage $stage, $n ranks, $mode: measured model state = ${r} x ZeRO's formula ($(grep -o 'by ZeRO.s formula ([^)]*)' "$out.log" | head -1 | cut -c18-))"
      else fail "memory stage $stage $n ranks $mode: ${r:-} $(tail -2 "$out.log")"; fi
    done
  done
done
# Note [ZeRO without masters]: no masters and bf16 moments, K = 4 B (8 B/param over the ranks).
out="$work/mem-nomasters-s3-n2"
if ranks mpi 2 "$out" --set zero.stage=3 --set train.max_steps=1 --set model.n_embd=128 \
     --set model.n_layer=4 --set 'precision.mode="full_bf16"' --set 'optimizer.master_dtype="bf16"' \
     --set 'optimizer.state_dtype="bf16"' --set train.log_level=info && r=$(memory "$out") &&
   "$python" -c "import sys; sys.exit(0 if abs($r - 1) <= 0.02 else 1)" && grep -q 'K = 4 B' "$out.log"; then
  ok "stage 3, 2 ranks, bf16 weights without masters and bf16 moments: measured model state = ${r} x ZeRO's formula ($(grep -o 'by ZeRO.s formula ([^)]*)' "$out.log" | head -1 | cut -c18-))"
else fail "memory without masters: ${r:-} $(tail -2 "$out.log")"; fi

# --- a 4-rank stage-3 run checkpointed at step 4 resumes on 2 and on 3 ranks (same global
# batch of 12)
base=(--set optimizer.eps=1e-5 --set zero.stage=3 --set train.gradient_accumulation_steps=1 --set train.save_steps=$mid)
ranks gloo 4 "$work/r4" "${base[@]}" --set train.per_device_train_batch_size=3 ||
  fail "4-rank run to reshard: $(tail -3 "$work/r4.log")"
for n in 2 3; do
  mkdir -p "$work/r$n" && cp -r "$work/r4/checkpoint-$mid" "$work/r$n/"
  backend=mpi; [ $n -eq 3 ] && backend=gloo
  if ranks $backend $n "$work/r$n" "${base[@]}" --set train.per_device_train_batch_size=$((12 / n)) \
       --set train.resume=latest --set train.log_level=info &&
     grep -q "resuming a 4-rank checkpoint on $n ranks" "$work/r$n.log" &&
     d=$(same_params "$work/r4" "$work/r$n" 1e-6); then
    ok "4-rank stage-3 checkpoint-$mid resumed on $n ranks ($backend) == the 4-rank run ($d)"
  else fail "reshard 4 -> $n: ${d:-} $(grep -v '^\s*$' "$work/r$n.log" | tail -4)"; fi
done
# ...and on one process with plain data parallelism (stage 0 reads the sharded weights).
mkdir -p "$work/r1" && cp -r "$work/r4/checkpoint-$mid" "$work/r1/"
if ranks none 1 "$work/r1" "${base[@]}" --set zero.stage=0 --set train.per_device_train_batch_size=12 \
     --set train.resume=latest && d=$(same_params "$work/r4" "$work/r1" 1e-6); then
  ok "4-rank stage-3 checkpoint-$mid resumed by one stage-0 process == the 4-rank run ($d)"
else fail "reshard 4 -> 1 (stage 0): ${d:-} $(tail -3 "$work/r1.log")"; fi
# The consolidated model equals the single process's, in a file Python's safetensors reads (its
# numpy loader: the same reader without importing torch, ~4 s of CPU).
ranks none 1 "$work/r-single" "${base[@]}" --set zero.stage=0 --set train.per_device_train_batch_size=12 &&
  d=$(same_params "$work/r-single" "$work/r4" 1e-6) &&
  n=$("$python" -c "from safetensors.numpy import load_file; t = load_file('$work/r4.c$last.safetensors'); print(len(t), t['h.1.attn.qkv.weight'].dtype)") &&
  ok "loom consolidate of the 4-rank stage-3 checkpoint == 1 process ($d; Python reads $n)" ||
  fail "consolidate: ${d:-} ${n:-}"

# Note [Partial model files]: the stage-3 checkpoint's model.safetensors holds only the
# whole-kept tensors and says so (Python sees it in the metadata); the stage-0 one is whole and
# unmarked; a from_pretrained folder holding the partial file is refused by check and by run,
# with one message, before output_dir is made.
tensors=("$python" "$src/tests/support/tensors.py")
partial=$("${tensors[@]}" metadata "$work/r4/checkpoint-$last/model.safetensors" loom_partial)
whole=$("${tensors[@]}" metadata "$work/r-single/checkpoint-$last/model.safetensors" loom_partial)
[[ $partial == *"of the model's"*"loom consolidate"* ]] && [ -z "$whole" ] &&
  ok "a stage-3 checkpoint's model.safetensors is marked partial (${partial:0:50}...), stage 0's is not" ||
  fail "partial mark: '$partial' / '$whole'"
"$loom" export "$work/r4/checkpoint-$last" "$work/r4-export" >/dev/null &&
  cp "$work/r4/checkpoint-$last/model.safetensors" "$work/r4-export/model.safetensors"
pretrained=(--set "model.from_pretrained=\"$work/r4-export\"" --set "train.output_dir=$work/from-partial")
check_err=$("$loom" check "$job" "${pretrained[@]}" 2>&1 >/dev/null); check_rc=$?
run_out=$("$loom" run "$job" "${pretrained[@]}" 2>&1); run_rc=$?
run_err=$(grep "^loom: error" <<<"$run_out")
if [ $check_rc -ne 0 ] && [ $run_rc -ne 0 ] && [[ $check_err == *"is not a whole model"* ]] &&
   [ "$check_err" = "$run_err" ] && [ ! -e "$work/from-partial" ]; then
  ok "from_pretrained of a partial model file: refused by check and run alike, nothing written"
else fail "from_pretrained partial (check $check_rc, run $run_rc): $check_err / $run_err"; fi

# --- ranks started with Slurm's variables, as srun starts them (rendezvous from MASTER_ADDR)
port=$((port + 1))
for r in 0 1; do
  env -u RANK -u WORLD_SIZE SLURM_PROCID=$r SLURM_LOCALID=$r SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=2 \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 300 "$loom" run "$job" --set "train.output_dir=$work/slurm" \
    --set optimizer.eps=1e-5 --set zero.stage=3 --set 'distributed.backend="gloo"' >"$work/slurm$r.log" 2>&1 &
  eval "spid$r=$!"
done
wait $spid0; c0=$?; wait $spid1; c1=$?
if [ $c0 -eq 0 ] && [ $c1 -eq 0 ] && d=$(same_params "$work/adamw-ref2" "$work/slurm" 1e-6); then
  ok "2 ranks from SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS, stage 3 == 1 process ($d)"
else fail "slurm variables: ${d:-} $(tail -3 "$work/slurm0.log")"; fi

# --- bad input
expect_error "stage 4" "[zero] stage must be 0, 1, 2 or 3" "$loom" run "$job" --set "train.output_dir=$work/bad" --set zero.stage=4
expect_error "stage -1" "[zero] stage must be 0, 1, 2 or 3" "$loom" run "$job" --set "train.output_dir=$work/bad" --set zero.stage=-1
expect_error "bucket size" "[zero] reduce_bucket_size must be positive" "$loom" run "$job" --set "train.output_dir=$work/bad" --set zero.reduce_bucket_size=0
expect_error "zero and ddp" "slot 'grad_sync' is claimed twice" "$loom" run "$job" --set "train.output_dir=$work/bad" --set ddp.reduce_bucket_size=100
sed -e 's/^model = "gpt"/model = "plain_lm"/' -e '/^\[model\]/,/^$/d' "$job" >"$work/plain.toml"
expect_error "stage 3 without units" "has no loom::nn::UnitList" "$loom" run "$work/plain.toml" \
  --set "train.output_dir=$work/bad" --set zero.stage=3
expect_error "consolidate: no folder" "does not exist" "$loom" consolidate "$work/nope" "$work/x.safetensors"
expect_error "consolidate: no output" "needs a checkpoint folder and an output file" "$loom" consolidate "$work/r4/checkpoint-$last"
# A diverged rank: rank 1 skips unit 1's forward at step 3, so it sends unit 0's chunk where
# the others gather unit 1 (the two units are the same size): named, within the timeout.
start=$SECONDS
expect_error "diverged rank" "but rank 1 sent those of unit" timeout 120 "$launch" --nproc-per-node 2 \
  --master-port $((port += 1)) "$loom" run "$job" --set "train.output_dir=$work/diverged" \
  --set zero.stage=3 --set 'chaos.mode="skip_unit"' --set chaos.step=3 --set distributed.timeout_seconds=20
[ $((SECONDS - start)) -lt 60 ] || fail "the diverged rank took $((SECONDS - start)) s to be noticed"
drop_older() {  # RUN: every checkpoint but checkpoint-$last goes
  find "$1" -maxdepth 1 -name 'checkpoint-*' ! -name "checkpoint-$last" -exec rm -rf {} +
}
# A shard gone: the error names it, before any state changed.
cp -r "$work/r4" "$work/gone" && rm "$work/gone/checkpoint-$last/optimizer-00002-of-00004.safetensors"
drop_older "$work/gone"
expect_error "missing shard" "optimizer-00002-of-00004.safetensors' is missing" \
  "$loom" run "$job" --set "train.output_dir=$work/gone" "${base[@]}" --set train.max_steps=$((last + 2)) --set train.resume=latest
# A shard of another step in its place: named.
cp -r "$work/r4" "$work/mixed" && cp "$work/r4/checkpoint-$mid/optimizer-00001-of-00004.safetensors" "$work/mixed/checkpoint-$last/"
drop_older "$work/mixed"
expect_error "shard of another step" "optimizer-00001-of-00004.safetensors" \
  "$loom" run "$job" --set "train.output_dir=$work/mixed" "${base[@]}" --set train.max_steps=$((last + 2)) --set train.resume=latest
# A truncated shard: named, by its size, before any state changed.
cp -r "$work/r4" "$work/short" && drop_older "$work/short" &&
  truncate -s 1000 "$work/short/checkpoint-$last/optimizer-00003-of-00004.safetensors"
expect_error "truncated shard" "optimizer-00003-of-00004.safetensors' is truncated" \
  "$loom" run "$job" --set "train.output_dir=$work/short" "${base[@]}" --set train.max_steps=$((last + 2)) --set train.resume=latest
# Another model shape: the sharded tensor is named with both shapes.
cp -r "$work/r4" "$work/wider" && drop_older "$work/wider"
expect_error "another model shape" "the checkpoint belongs to another model shape" \
  "$loom" run "$job" --set "train.output_dir=$work/wider" "${base[@]}" --set model.n_embd=48 \
  --set train.max_steps=$((last + 2)) --set train.resume=latest
# Another update rule's state.
cp -r "$work/r4" "$work/other" && drop_older "$work/other"
expect_error "another rule" "holds optimizer state of 'adamw' but the job uses 'lion'" \
  "$loom" run "$job" --set "train.output_dir=$work/other" --set zero.stage=2 --set optimizer.name=lion \
  --set train.max_steps=$((last + 2)) --set train.resume=latest

# NVMe offload of the optimizer state (Note [Offloaded ZeRO]): stage 0 over 2 ranks (each rank
# its own swap file holding all), and stages 1-3 (each rank its pieces) for adamw, adafactor and
# adam8bit, and bf16 weights (fp32 masters in the file) at stage 3: bitwise the in-memory runs
# above (their final checkpoints byte for byte, testlib.sh's same_checkpoint_files: one
# layout, so no `loom consolidate` of each); the swap files gone after.
mkdir -p "$work/swap"
nvme=(--set "zero.offload_optimizer={device=\"nvme\", nvme_path=\"$work/swap\", queue_depth=4, buffer_count=3}")
offload_case() {  # NAME BACKEND IN-MEMORY-RUN ARGS...
  local name=$1 backend=$2 memory=$3 out="$work/off-${1// /-}" d=""; shift 3
  if ranks "$backend" 2 "$out" "$@" "${nvme[@]}" &&
     d=$(same_checkpoint_files "$memory/checkpoint-$last" "$out/checkpoint-$last") && [ -z "$(ls -A "$work/swap")" ]; then
    ok "offloaded optimizer state, $name on 2 ranks ($backend) == in memory ($d)"
  else fail "offload $name: ${d:-} $(grep -v '^\s*$' "$out.log" | tail -3)"; fi
}
ranks mpi 2 "$work/off-memory" --set optimizer.eps=1e-5 --set zero.stage=0 ||
  fail "stage 0 in memory: $(tail -3 "$work/off-memory.log")"
offload_case "stage 0" mpi "$work/off-memory" --set optimizer.eps=1e-5 --set zero.stage=0
for rule in adamw adafactor adam8bit; do
  # shellcheck disable=SC2086
  sets=(${rule_sets[$rule]})
  for stage in 1 2 3; do
    backend=mpi; [ $stage -eq 2 ] && backend=gloo  # as check_rule ran them
    offload_case "$rule stage $stage" $backend "$work/$rule-s$stage-n2" "${sets[@]}" --set zero.stage=$stage
  done
done
offload_case "bf16 stage 3" gloo "$work/bf16-s3" "${bf16[@]}" --set zero.stage=3 \
  --set train.gradient_accumulation_steps=1
# Note [ZeRO without masters]: bf16 weights without masters, the file holding the state alone.
offload_case "no masters stage 3" gloo "$work/nm-s3" "${nm[@]}" --set zero.stage=3 --set train.save_steps=$mid
# ... and the units' weight shards on NVMe too (Note [Offloaded parameters]).
offload_case "bf16 stage 3 with offload_param" gloo "$work/bf16-s3" "${bf16[@]}" --set zero.stage=3 \
  --set train.gradient_accumulation_steps=1 \
  --set "zero.offload_param={device=\"nvme\", nvme_path=\"$work/swap\", queue_depth=4}"

# ... and in host memory (Note [Host store]: device = "cpu", a GPU run's ZeRO-Offload, run on the
# CPU as its twin with LOOM_OFFLOAD_CPU_STORE=1): adam8bit at stage 2 and bf16 at stage 3, whose
# units' weight shards go to a host store of their own too, each fetched to the "device" a unit
# ahead (Note [Parameter offload twin]).
export LOOM_OFFLOAD_CPU_STORE=1
nvme=(--set "zero.offload_optimizer={device=\"cpu\"}")
# shellcheck disable=SC2086
sets=(${rule_sets[adam8bit]})
offload_case "in host memory, adam8bit stage 2" gloo "$work/adam8bit-s2-n2" "${sets[@]}" --set zero.stage=2
offload_case "in host memory, bf16 stage 3 with offload_param" gloo "$work/bf16-s3" "${bf16[@]}" \
  --set zero.stage=3 --set train.gradient_accumulation_steps=1 --set "zero.offload_param={device=\"cpu\"}"
offload_case "in host memory, no masters stage 2" mpi "$work/nm-s2" "${nm[@]}" --set zero.stage=2 --set train.save_steps=$mid
unset LOOM_OFFLOAD_CPU_STORE

# [train] auto_find_batch_size on 2 ranks: each rank probes alone (Note [Solo probes]) and both
# take the job's 2 x 4 samples per step in one micro-batch; ranks that choose differently (here
# from different jobs' samples per step) are an error naming the key, not a silent mismatch.
auto=(--set train.auto_find_batch_size=true --set 'train.memory_budget="4GiB"' --set train.log_level='"info"')
if ranks mpi 2 "$work/auto" --set optimizer.eps=1e-5 --set train.gradient_accumulation_steps=4 "${auto[@]}" &&
   [ "$(grep -c "auto_find_batch_size: per_device_train_batch_size = 8, gradient_accumulation_steps = 1" "$work/auto.log")" -eq 2 ] &&
   [ -d "$work/auto/checkpoint-$last" ]; then ok "auto_find_batch_size on 2 ranks: 8 x 1 on both"
else fail "auto_find_batch_size on 2 ranks: $(tail -3 "$work/auto.log")"; fi
port=$((port + 1))
for r in 0 1; do
  env -u RANK -u WORLD_SIZE SLURM_PROCID=$r SLURM_LOCALID=$r SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=2 \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 120 "$loom" run "$job" --set "train.output_dir=$work/auto-split" \
    --set 'distributed.backend="gloo"' --set train.gradient_accumulation_steps=4 \
    --set "train.per_device_train_batch_size=$((r + 1))" "${auto[@]}" >"$work/auto-split$r.log" 2>&1 &
  eval "apid$r=$!"
done
wait $apid0; a0=$?; wait $apid1; a1=$?
if [ $a0 -ne 0 ] && [ $a1 -ne 0 ] && grep -q "auto_find_batch_size chose per-device batches from 4 to 8" "$work/auto-split0.log"; then
  ok "auto_find_batch_size: ranks that chose differently are an error"
else fail "auto_find_batch_size disagreement (exit $a0, $a1): $(tail -3 "$work/auto-split0.log")"; fi

# Note [DeepSpeed config files]: the job without its [zero] table, driven by a ds_config.json
# that says the same (stage 3, the buckets, AdamW's eps, 8 = 2 x 2 x 2 ranks), trains to the
# very parameters of the loom-keyed stage-3 run on 2 ranks.
sed '/^\[zero\]/,$d' "$job" >"$work/ds_job.toml"
cat >"$work/ds3.json" <<'JSON'
{ "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
  "gradient_clipping": 0.5, "steps_per_print": 10,
  "optimizer": { "type": "AdamW", "params": { "lr": 1e-3, "eps": 1e-5 } },
  "zero_optimization": { "stage": 3, "reduce_bucket_size": 20000, "contiguous_gradients": true,
                         "stage3_param_persistence_threshold": 0 } }
JSON
saved_job=$job job=$work/ds_job.toml
if ranks mpi 2 "$work/ds-s3" --deepspeed "$work/ds3.json" &&
   d=$(same_checkpoint_files "$work/adamw-s3-n2/checkpoint-$last" "$work/ds-s3/checkpoint-$last"); then
  ok "a DeepSpeed config file, stage 3 on 2 ranks == the loom-keyed job ($d)"
else fail "DeepSpeed config stage 3: ${d:-} $(tail -3 "$work/ds-s3.log")"; fi
job=$saved_job

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
