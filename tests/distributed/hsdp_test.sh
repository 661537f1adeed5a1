#!/usr/bin/env bash
# Hybrid sharding, [zero] shard_group_size (Note [Hybrid sharding] in
# sharding/include/loom/sharding/zero_driver.h), with real processes: 4 ranks as 2 groups of 2 at
# stages 1, 2 and 3 (mpi and gloo), and as 4 groups of 1 (pure replication), end with the
# parameters and every step's grad_norm of 1 process with the same global batch (8 steps,
# accumulation 2, clipping), for adamw and (stage 2) adafactor; with bf16 weights at stages 2 and
# 3 they are bitwise stage 0's on 4 ranks, and with the optimizer state on NVMe bitwise the
# in-memory run's; the elements each rank sends across groups per step are Psi/G whatever the
# accumulation, the groups' own traffic is ZeRO's; the model state per rank is ZeRO's formula with
# G for N; a 2 x 2 checkpoint holds one copy of the state (group 0's files), records its group
# size, resumes on 2 ranks and on 4 ranks as 4 x 1 to the uninterrupted run, and `loom
# consolidate` reads it; a shard_group_size that does not divide the world, exceeds it, is
# negative, or is set at stage 0 is refused by name.
# usage: hsdp_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
# shellcheck source=testlib.sh
source "$2/tests/distributed/testlib.sh"
ranks_test_setup zero_job.toml "$@"

# --- 4 ranks x batch 2 == 1 process x batch 8 (zero_test.sh's check_rule tolerance for adamw:
# the sums differ from one process's in the last bits only).
# 8 steps (the job's 20 cut: the same accumulation, clipping and a mid-run checkpoint, at 2/5 the
# cost), a checkpoint at step 4.
steps=(--set train.max_steps=8)
common=(--set optimizer.eps=1e-5 "${steps[@]}" --set train.save_steps=4)
ranks none 1 "$work/ref" "${common[@]}" --set zero.stage=0 --set train.per_device_train_batch_size=8 ||
  fail "reference: $(tail -3 "$work/ref.log")"
# Clipping (max_grad_norm 0.5) would hide a gradient of the wrong scale from the weights, so
# every step's grad_norm is held to one process's too.
same_grad_norms() {  # A B: every step's grad_norm within 1e-6 (relative)
  "$python" - "$1/metrics.jsonl" "$2/metrics.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["grad_norm"] for l in open(f) if '"grad_norm"' in l] for f in sys.argv[1:])
assert len(a) == len(b) == 8 and all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(a, b)), (a, b)
PY
}
hybrid() {  # NAME BACKEND STAGE G
  local out="$work/$1" d=""
  if ranks "$2" 4 "$out" "${common[@]}" --set zero.stage="$3" --set zero.shard_group_size="$4" \
       --set train.log_level=info &&
     d=$(same_params "$work/ref" "$out" 1e-6 8) && same_grad_norms "$work/ref" "$out"; then
    ok "stage $3, 4 ranks as $((4 / $4)) x $4 over $2 == 1 process x batch 8 ($d; grad_norm every step)"
  else fail "stage $3, 4 ranks, shard_group_size $4 ($2): ${d:-} $(grep -v '^\s*$' "$out.log" | tail -4)"; fi
}
hybrid s2-g2 gloo 2 2
hybrid s3-g2 mpi 3 2
hybrid s1-g2 mpi 1 2
hybrid s2-g1 mpi 2 1
hybrid s3-g4 gloo 3 4
# Adafactor's row statistics are partial sums over the group's pieces (every replica holds the
# same): the same weights as one process too.
adafactor=(--set optimizer.name=adafactor --set optimizer.eps1=1e-10 "${steps[@]}")
if ranks none 1 "$work/ada-ref" "${adafactor[@]}" --set zero.stage=0 --set train.per_device_train_batch_size=8 &&
   ranks gloo 4 "$work/ada-s2-g2" "${adafactor[@]}" --set zero.stage=2 --set zero.shard_group_size=2 &&
   d=$(same_params "$work/ada-ref" "$work/ada-s2-g2" 1e-6 8); then
  ok "adafactor, stage 2, 4 ranks as 2 x 2 == 1 process x batch 8 ($d)"
else fail "adafactor 2 x 2: ${d:-} $(tail -3 "$work/ada-s2-g2.log")"; fi
# bf16 weights: each chunk is summed over the groups in fp32 and rounded to bf16 once, as
# stage 0 rounds its fp32 buckets: bitwise data parallelism (without accumulation, as
# zero_test.sh compares stages 2 and 3, whose shards accumulate micro-steps in bf16).
bf16=(--set optimizer.eps=1e-5 --set 'precision.mode="full_bf16"' --set train.gradient_accumulation_steps=1 "${steps[@]}")
ranks mpi 4 "$work/bf16-s0" "${bf16[@]}" --set zero.stage=0 || fail "bf16 stage 0: $(tail -3 "$work/bf16-s0.log")"
for stage in 2 3; do
  backend=mpi; [ $stage -eq 3 ] && backend=gloo
  if ranks $backend 4 "$work/bf16-s$stage" "${bf16[@]}" --set zero.stage=$stage --set zero.shard_group_size=2 &&
     d=$(same_params "$work/bf16-s0" "$work/bf16-s$stage" 0 8); then
    ok "bf16 weights, stage $stage, 4 ranks as 2 x 2 ($backend) == stage 0 on 4 ranks ($d)"
  else fail "bf16 stage $stage 2 x 2: ${d:-} $(tail -3 "$work/bf16-s$stage.log")"; fi
done
# The optimizer state on NVMe (Note [Offloaded ZeRO]) under hybrid sharding: bitwise in memory
# (the final checkpoints byte for byte: one layout, testlib.sh's same_checkpoint_files).
mkdir -p "$work/swap"
if ranks mpi 4 "$work/s3-g2-nvme" "${common[@]}" --set zero.stage=3 --set zero.shard_group_size=2 \
     --set "zero.offload_optimizer={device=\"nvme\", nvme_path=\"$work/swap\"}" &&
   d=$(same_checkpoint_files "$work/s3-g2/checkpoint-8" "$work/s3-g2-nvme/checkpoint-8") &&
   [ -z "$(ls -A "$work/swap")" ]; then
  ok "stage 3, 2 x 2, optimizer state on NVMe == in memory ($d)"
else fail "stage 3 2 x 2 with NVMe offload: ${d:-} $(tail -3 "$work/s3-g2-nvme.log")"; fi
grep -q "over 2 rank(s) (shard group 0 of 2 replicas" "$work/s2-g2.log" &&
  ok "the log names the shard group and the replicas" ||
  fail "no shard group in the log: $(grep -m1 'zero: ZeRO' "$work/s2-g2.log")"

# --- traffic per rank and step, in elements (fp32, 4 bytes each): across groups, one
# all-reduce of the rank's gradient chunks, Psi/G plus padding, once per window although the
# window has 2 micro-steps (a ring over R = N/G replicas sends 2 (R-1)/R of it); within the
# group, ZeRO's own: 2 reduce-scatters and 1 all-gather of Psi at stage 2 (3 Psi), as at G = N.
per_psi() {  # DIR KEY: the KEY metric of step 1 / trainable parameters ("none" when absent)
  "$python" - "$1" "$2" <<'PY'
import json, sys
run = json.load(open(sys.argv[1] + "/run.json"))
step = json.loads(open(sys.argv[1] + "/metrics.jsonl").readline())
print(f"{step[sys.argv[2]] / run['model_state']['trainable_params']:.4f}" if sys.argv[2] in step else "none")
PY
}
within() { "$python" -c "import sys; sys.exit(0 if $2 <= $1 <= $2 * 1.02 else 1)"; }  # X WANT
for g in 2 1; do
  for stage in 1 2 3; do
    [ -d "$work/s$stage-g$g" ] || continue
    x=$(per_psi "$work/s$stage-g$g" zero_cross_group_elements)
    want=$("$python" -c "print(1 / $g)")
    within "$x" "$want" && ok "stage $stage, 4 ranks as $((4 / g)) x $g: $x x Psi elements sent across groups per rank and step (want Psi/G = $want Psi)" ||
      fail "stage $stage G=$g cross-group elements $x Psi, want $want Psi"
  done
done
t=$(per_psi "$work/s2-g2" zero_comm_elements)
within "$t" 3.5 && ok "stage 2, 2 x 2: $t x Psi elements in all collectives per rank and step (3 Psi in the group + Psi/2 across)" ||
  fail "stage 2 G=2 total elements $t Psi, want 3.5 Psi"
x=$(per_psi "$work/s3-g4" zero_cross_group_elements)
[ "$x" = none ] && ok "shard_group_size = world: no traffic across groups reported" ||
  fail "G = N reports cross-group elements: $x"

# --- model-state bytes per rank: the memory tracker after the first update against ZeRO's
# formula with Psi/G (a 0.8 M-parameter model, as zero_test.sh; at stage 2 in fp32 Psi/4 would
# give 7 Psi bytes, Psi/2 gives 10 Psi: far apart).
out="$work/mem-g2"
if ranks mpi 4 "$out" --set zero.stage=2 --set zero.shard_group_size=2 --set train.max_steps=1 \
     --set model.n_embd=128 --set model.n_layer=4 --set train.log_level=info &&
   r=$("$python" - "$out/metrics.jsonl" <<'PY'
import json, sys
m = json.loads(open(sys.argv[1]).readline())
print(f"{m['zero_model_state_measured_bytes'] / m['zero_model_state_formula_bytes']:.4f}")
PY
) && "$python" -c "import sys; sys.exit(0 if abs($r - 1) <= 0.02 else 1)" &&
   grep -q "N = 2," "$out.log"; then
  ok "stage 2, 4 ranks as 2 x 2: measured model state = $r x ZeRO's formula with N = G = 2"
else fail "memory with shard_group_size 2: ${r:-} $(grep -o 'by ZeRO.s formula ([^)]*)' "$out.log" | head -1) $(tail -2 "$out.log")"; fi

# `loom estimate` (model states only): on 4 ranks in groups of 2, stages 1-3 hold what 2 ranks
# hold, not what 4 do; stage 0 keeps the world's gradient buckets.
states() {  # WORLD SETS...: the model-state rows of stages 1-3 (stage, offload, precision, 4 columns)
  local world=$1; shift
  "$loom" estimate "$job" --no-probe --world-size "$world" "$@" 2>/dev/null |
    awk '$1 ~ /^[123]$/ {print $1, $2, $3, $4, $5, $6, $7}'
}
g2=$(states 4 --set zero.shard_group_size=2 --set zero.stage=3) two=$(states 2 --set zero.stage=3)
four=$(states 4 --set zero.stage=3)
header=$("$loom" estimate "$job" --no-probe --world-size 4 --set zero.shard_group_size=2 2>/dev/null | head -1)
if [ -n "$g2" ] && [ "$g2" = "$two" ] && [ "$g2" != "$four" ] &&
   [[ $header == *"4 rank(s) (stages 1-3 sharded over groups of 2"* ]]; then
  ok "loom estimate: 4 ranks in groups of 2 hold 2 ranks' model states at stages 1-3"
else fail "estimate with shard_group_size: '$header' $(diff <(echo "$g2") <(echo "$two") | head -4)"; fi

# --- checkpoints: group 0 writes the pieces (ranks 2 and 3 write empty files), once; the
# manifest records the group size; checkpoint-4 resumes on 2 ranks (stage 3 over both) and on
# 4 ranks as 4 x 1 (stage 2, every rank whole state) to the uninterrupted 2 x 2 run.
if "$python" - "$work/s3-g2/checkpoint-4" <<'PY'
import json, sys
from safetensors import safe_open
folder = sys.argv[1]
manifest = json.load(open(folder + "/manifest.json"))
counts = []
for shard in manifest["optimizer_shards"]:
    with safe_open(folder + "/" + shard["file"], "np") as f:
        counts.append(len(list(f.keys())))
assert len(counts) == 4 and counts[0] > 0 and counts[1] > 0 and counts[2:] == [0, 0], counts
assert manifest["values"]["zero.shard_group_size"] == "2", manifest["values"]
assert manifest["world_size"] == 4, manifest["world_size"]
PY
then ok "a 2 x 2 stage-3 checkpoint: group 0's files hold the pieces, the replicas' are empty; the manifest says shard_group_size 2"
else fail "2 x 2 checkpoint layout"; fi
resume() {  # NAME BACKEND N STAGE G
  local out="$work/$1" d=""
  mkdir -p "$out" && cp -r "$work/s3-g2/checkpoint-4" "$out/"
  if ranks "$2" "$3" "$out" "${common[@]}" --set zero.stage="$4" --set zero.shard_group_size="$5" \
       --set train.per_device_train_batch_size=$((8 / $3)) --set train.resume=latest \
       --set train.log_level=info &&
     { [ "$3" -eq 4 ] || grep -q "resuming a 4-rank checkpoint on $3 ranks" "$out.log"; } &&
     d=$(same_params "$work/s3-g2" "$out" 1e-6 8); then
    ok "2 x 2 stage-3 checkpoint-4 resumed on $3 ranks, stage $4, shard_group_size $5 == the 2 x 2 run ($d)"
  else fail "resume $1: ${d:-} $(grep -v '^\s*$' "$out.log" | tail -4)"; fi
}
resume r2 gloo 2 3 0
resume r4-g1 mpi 4 2 1

# --- bad input: named, non-zero exit, before any training
for bad in 3 8; do
  expect_error "shard_group_size $bad on 4 ranks" "[zero] shard_group_size = $bad must divide the world size 4" \
    timeout 120 mpirun --oversubscribe --bind-to none -x LOOM_PLUGIN_PATH -np 4 "$loom" run "$job" \
    --set "train.output_dir=$work/bad$bad" --set zero.shard_group_size=$bad
  [ -d "$work/bad$bad/checkpoint-20" ] && fail "shard_group_size $bad trained anyway"
done
expect_error "shard_group_size -1" "[zero] shard_group_size must be a positive number of ranks" \
  "$loom" check "$job" --set zero.shard_group_size=-1
expect_error "shard_group_size at stage 0" "but stage = 0 shards nothing" \
  "$loom" check "$job" --set zero.stage=0 --set zero.shard_group_size=2

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
