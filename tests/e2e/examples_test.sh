#!/usr/bin/env bash
# The example jobs of examples/README.md, each run at tiny scale (3 steps; the GPT jobs with 2
# blocks 32 wide on 32-byte windows) by the very command its table shows: the command must be
# in the table as written, and runs from the source root with this build's binaries, the test's
# Python, a master port of its own and mpirun's options for a shared machine, plus `--set`
# overrides. Each run is held to what its row claims: every step's loss finite in
# metrics.jsonl; the chat SFT's evaluation and LoRA adapter files; the DDP job's losses equal
# under loom-launch, mpirun and torchrun; ZeRO-3's model-state report from every rank and a
# checkpoint of shards; NVMe offload's swap files made in nvme_path and removed; the MoE
# metrics; activation checkpointing's weights bitwise those without it; the long fp16 run's
# background saves, its fallback (forced) in metrics.jsonl and the manifest, and its resume in
# the fallen-back mode; the hang-debugging job naming both ranks' calls when the test's chaos
# plugin skips a collective on one; the one-GPU offload job `loom check`ed as written (for CUDA)
# and run as its CPU twin. The stories run by other tests (demo, finetune_lm,
# classify) are checked to still be run there; finetune_lm and classify are `loom check`ed on
# examples/tiny_models.py's folders, which the chat SFT trains from.
# usage: examples_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
build=$1 src=$2 python=$3
work=$(mktemp -d)
trap cleanup_work EXIT  # testlib.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# shellcheck source=../distributed/testlib.sh
source "$src/tests/distributed/testlib.sh"
table=$src/examples/README.md
cd "$src" || exit 1
start=$SECONDS

# The GPT jobs at tiny scale; only the final checkpoint is written.
tiny=(--set train.max_steps=3 --set train.per_device_train_batch_size=2 --set train.save_steps=0
      --set train.logging_steps=1 --set train.progress_bar=false --set data.seq_len=32
      --set model.n_layer=2 --set model.n_embd=32 --set model.n_head=2)

# command_of COMMAND [RANKS]: `cmd`, the array that runs COMMAND (which examples/README.md
# must show in backticks) here, with RANKS in place of its --nproc-per-node when given.
command_of() {
  local command=$1 ranks=${2:-} word previous=""
  cmd=()
  if ! grep -qF -- "\`$command\`" "$table"; then
    fail "examples/README.md no longer shows \`$command\`"
    return 1
  fi
  for word in $command; do
    [ -n "$ranks" ] && [ "$previous" = --nproc-per-node ] && word=$ranks
    case $word in
      build/bin/*) cmd+=("$build/bin/${word#build/bin/}") ;;
      .venv/bin/python) cmd+=("$python") ;;
      *) cmd+=("$word") ;;
    esac
    case $word in
      build/bin/loom-launch | torch.distributed.run) port=$((port + 1)); cmd+=(--master-port "$port") ;;
      mpirun) cmd+=(--oversubscribe --bind-to none) ;;
    esac
    previous=$word
  done
}
# story NAME COMMAND [--ranks N] ARGS...: COMMAND (as command_of) with ARGS; output in
# $work/NAME.log (the caller shows its end on a failure), its run in $work/NAME.
story() {
  local name=$1 command=$2 ranks=""
  shift 2
  if [ "${1:-}" = --ranks ]; then ranks=$2; shift 2; fi
  command_of "$command" "$ranks" || return 1
  timeout 300 "${cmd[@]}" "$@" --set "train.output_dir=$work/$name" >"$work/$name.log" 2>&1
}
# steps_ok NAME STEPS [FIELD...]: $work/NAME/metrics.jsonl has the step lines 1..STEPS, each
# with a finite loss and FIELDs; prints the losses.
steps_ok() {
  "$python" - "$work/$1/metrics.jsonl" "${@:2}" <<'PY'
import json, math, sys
file, steps, fields = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = [json.loads(line) for line in open(file)]
train = [r for r in rows if "loss" in r]
assert [r["step"] for r in train] == list(range(1, steps + 1)), [r["step"] for r in train]
for r in train:
    for field in ["loss"] + fields:
        assert field in r and math.isfinite(r[field]), (field, r)
print(" ".join(repr(r["loss"]) for r in train))
PY
}

# --- stories 1-3 are run by other tests: still there, under the name the table gives.
for pair in "examples/demo.toml:tests/e2e/cli_test.sh" \
            "datasets/finetune_lm.toml:tests/plugins/gpt/test_gpt_hf.cpp" \
            "datasets/classify.toml:tests/plugins/bert/test_bert_hf.cpp"; do
  grep -qF "${pair%%:*}" "${pair#*:}" && ok "${pair%%:*} is run by ${pair#*:}" ||
    fail "${pair#*:} no longer runs ${pair%%:*}; examples/README.md says it does"
done
for command in "build/bin/loom run examples/demo.toml" \
               "build/bin/loom run examples/datasets/finetune_lm.toml" \
               "build/bin/loom run examples/datasets/classify.toml"; do
  command_of "$command" && ok "the table shows \`$command\`"
done

# --- 2-4: the model folders of examples/tiny_models.py.
models=$work/models
if "$python" examples/tiny_models.py "$models" >"$work/models.log" 2>&1; then
  ok "tiny_models.py writes my-gpt2, my-bert, my-llama"
else fail "tiny_models.py: $(tail -3 "$work/models.log")"; fi
for check in "finetune_lm my-gpt2" "classify my-bert" "finetune_lm my-llama --set train.model=llama"; do
  read -r job folder extra <<<"$check"
  # shellcheck disable=SC2086
  if out=$("$build/bin/loom" check "examples/datasets/$job.toml" \
             --set "model.from_pretrained=$models/$folder" $extra 2>&1); then
    ok "loom check $job.toml on $folder"
  else fail "check $job.toml on $folder: $(tail -3 <<<"$out")"; fi
done

# --- 4: Llama LoRA SFT on chat JSONL, as written but 3 steps (an evaluation at the third).
if story chat-sft "build/bin/loom run examples/datasets/chat_sft.toml" \
     --set "model.from_pretrained=$models/my-llama" --set train.max_steps=3 \
     --set train.eval_steps=3 --set train.progress_bar=false &&
   losses=$(steps_ok chat-sft 3 trained_tokens) &&
   "$python" - "$work/chat-sft" <<'PY'; then
import json, math, sys
from safetensors import safe_open
out = sys.argv[1]
evals = [json.loads(l) for l in open(out + "/metrics.jsonl") if '"eval_loss"' in l]
assert [e["step"] for e in evals] == [3] and math.isfinite(evals[0]["eval_loss"]), evals
config = json.load(open(out + "/adapter_config.json"))
assert config["r"] == 16 and config["task_type"] == "CAUSAL_LM", config
with safe_open(out + "/adapter_model.safetensors", "np") as f:
    keys = list(f.keys())
assert any("q_proj.lora_A" in k for k in keys) and any("down_proj.lora_B" in k for k in keys), keys
PY
  ok "chat SFT with LoRA: losses $losses, eval_loss, the PEFT adapter files"
else fail "chat SFT: $(tail -3 "$work/chat-sft.log")"; fi

# --- 5: DDP on 2 ranks under each launcher: one world of 2 each time, the same losses.
ddp=examples/distributed/ddp.toml
launchers=("build/bin/loom-launch --nproc-per-node 2 build/bin/loom run $ddp"
           "mpirun -np 2 build/bin/loom run $ddp"
           ".venv/bin/python -m torch.distributed.run --nproc-per-node 2 --no-python build/bin/loom run $ddp")
names=(ddp-loom-launch ddp-mpirun ddp-torchrun)
ddp_losses=()
for i in 0 1 2; do
  name=${names[$i]}
  if story "$name" "${launchers[$i]}" "${tiny[@]}" && losses=$(steps_ok "$name" 3 ddp_comm_s) &&
     grep -q "ddp: .*2 ranks" "$work/$name.log"; then
    ok "DDP under ${name#ddp-}: 2 ranks, losses $losses"
    ddp_losses+=("$losses")
  else fail "DDP $name: $(grep -v '^\s*$' "$work/$name.log" | tail -3)"; fi
done
if [ ${#ddp_losses[@]} -eq 3 ] && "$python" - "${ddp_losses[@]}" <<'PY'; then
import sys
runs = [[float(x) for x in losses.split()] for losses in sys.argv[1:]]
worst = max(abs(a - b) / abs(b) for run in runs[1:] for a, b in zip(run, runs[0]))
assert worst <= 1e-6, runs
PY
  ok "the three launchers give the same losses"
else fail "DDP losses differ between launchers: ${ddp_losses[*]}"; fi

# --- 6: ZeRO-3, the 4-rank story on 2 ranks. The tiny model's tensors are all below stage 3's
# persistence threshold, which would keep them whole: 0 shards every block's weights.
shard_all=(--set zero.stage3_param_persistence_threshold=0)
if story zero3 "build/bin/loom-launch --nproc-per-node 4 build/bin/loom run examples/distributed/zero3.toml" \
     --ranks 2 "${tiny[@]}" "${shard_all[@]}" --set train.log_all_ranks=true &&
   losses=$(steps_ok zero3 3 zero_comm_s) &&
   grep -q "rank 0.*zero: model state on rank 0 after the first update" "$work/zero3.log" &&
   grep -q "rank 1.*zero: model state on rank 1 after the first update" "$work/zero3.log" &&
   [ -f "$work/zero3/checkpoint-3/optimizer-00001-of-00002.safetensors" ] &&
   "$build/bin/loom" consolidate "$work/zero3/checkpoint-3" "$work/zero3.safetensors" >/dev/null 2>&1; then
  ok "ZeRO-3 on 2 ranks: losses $losses, both ranks' model-state report, a shard per rank that consolidates"
else fail "ZeRO-3: $(grep -v '^\s*$' "$work/zero3.log" | tail -3)"; fi

# --- 7: NVMe offload into a folder of the test's: swap files there during the run, none after.
nvme=$work/nvme
mkdir -p "$nvme"
if command_of "build/bin/loom run examples/offload/nvme.toml"; then
  timeout 300 "${cmd[@]}" "${tiny[@]}" "${shard_all[@]}" --set "train.output_dir=$work/offload" \
    --set "zero.offload_optimizer={device=\"nvme\", nvme_path=\"$nvme\"}" \
    --set "zero.offload_param={device=\"nvme\", nvme_path=\"$nvme\"}" >"$work/offload.log" 2>&1 &
  pid=$! most=0
  while kill -0 $pid 2>/dev/null; do
    files=$(find "$nvme" -name 'loom-swap-*' | wc -l)
    [ "$files" -gt "$most" ] && most=$files
    sleep 0.05
  done
  wait $pid
  rc=$?
  if [ $rc -eq 0 ] && losses=$(steps_ok offload 3 offload_param_wait_s) && [ "$most" -eq 2 ] &&
     [ -z "$(ls -A "$nvme")" ]; then
    ok "NVMe offload: losses $losses, 2 swap files in nvme_path during the run, none after"
  else fail "NVMe offload: exit $rc, at most $most swap file(s), left: $(ls -A "$nvme") $(tail -3 "$work/offload.log")"; fi
fi

# --- 8: MoE, experts over 2 ranks.
if story moe "build/bin/loom-launch --nproc-per-node 2 build/bin/loom run examples/moe/moe.toml" \
     "${tiny[@]}" &&
   losses=$(steps_ok moe 3 aux_loss moe_load_max_over_mean moe_dropped_fraction) &&
   grep -q "8 experts, top-2, .* 2-way expert parallel" "$work/moe.log" &&
   "$python" -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '\"aux_loss\"' in l]
assert len(rows) == 3 and all(r['aux_loss'] > 0 for r in rows), rows" "$work/moe/metrics.jsonl"; then
  ok "MoE, expert parallel on 2 ranks: losses $losses, aux_loss and the moe_* metrics"
else fail "MoE: $(grep -v '^\s*$' "$work/moe.log" | tail -3)"; fi

# --- 9: a job driven by a DeepSpeed config file: ZeRO-2 with NVMe offload (the swap file sent to
# the test's folder by --set, which has the last word over the file), then the same job with the
# ZeRO-3 file on 2 ranks; the log says what each DeepSpeed key became.
if story deepspeed2 "build/bin/loom run examples/deepspeed/job.toml" "${tiny[@]}" \
     --set "zero.offload_optimizer={device=\"nvme\", nvme_path=\"$nvme\"}" &&
   losses=$(steps_ok deepspeed2 3) &&
   grep -qF 'scheduler.type = "WarmupDecayLR" -> [train] lr_scheduler_type = "ds_warmup_decay_lr"' "$work/deepspeed2.log" &&
   grep -qF 'zero_optimization.stage = 2 -> [zero] stage = 2' "$work/deepspeed2.log" &&
   grep -qF 'contiguous_gradients changes nothing in loom' "$work/deepspeed2.log" &&
   [ -z "$(ls -A "$nvme")" ]; then
  ok "DeepSpeed file, ZeRO-2 with NVMe offload: losses $losses, every key named in the log"
else fail "DeepSpeed ZeRO-2: $(grep -v '^\s*$' "$work/deepspeed2.log" | tail -3)"; fi
if story deepspeed3 "build/bin/loom-launch --nproc-per-node 2 build/bin/loom run examples/deepspeed/job.toml --deepspeed examples/deepspeed/ds_zero3.json" \
     "${tiny[@]}" "${shard_all[@]}" &&
   losses=$(steps_ok deepspeed3 3 zero_comm_s) &&
   grep -qF 'zero_optimization.stage = 3 -> [zero] stage = 3' "$work/deepspeed3.log" &&
   [ -f "$work/deepspeed3/checkpoint-3/optimizer-00001-of-00002.safetensors" ]; then
  ok "DeepSpeed file, ZeRO-3 on 2 ranks: losses $losses, a shard per rank"
else fail "DeepSpeed ZeRO-3: $(grep -v '^\s*$' "$work/deepspeed3.log" | tail -3)"; fi
# ... and DeepSpeed's low-precision keys: loom's master_dtype and state_dtype, no masters saved.
if story deepspeed3lp "build/bin/loom-launch --nproc-per-node 2 build/bin/loom run examples/deepspeed/job.toml --deepspeed examples/deepspeed/ds_zero3_bf16_low_precision.json" \
     "${tiny[@]}" "${shard_all[@]}" --set train.log_level=info &&
   losses=$(steps_ok deepspeed3lp 3) &&
   grep -qF 'bf16.bf16_master_weights_and_grads = true -> [optimizer] master_dtype = "bf16"' "$work/deepspeed3lp.log" &&
   grep -qF 'bf16.bf16_optimizer_states = true -> [optimizer] state_dtype = "bf16"' "$work/deepspeed3lp.log" &&
   grep -q "by ZeRO's formula (stage 3, N = 2, 2 B weights and grads, K = 4 B" "$work/deepspeed3lp.log" &&
   ! for shard in "$work/deepspeed3lp/checkpoint-3"/optimizer-*.safetensors; do
       safetensors_header "$shard"; done | grep -q 'master/'; then
  ok "DeepSpeed file with bf16 master weights and optimizer states, ZeRO-3 on 2 ranks: losses $losses, no masters, K = 4 B"
else fail "DeepSpeed low precision: $(grep -v '^\s*$' "$work/deepspeed3lp.log" | tail -3)"; fi

# --- 10: activation checkpointing, full on the first units and attention on the others, as
# written (dropout 0.1 and all) but first = 1 of the tiny model's 2 units: the log names the
# policy and the units; the weights after 3 steps are bitwise those of the same run without
# checkpointing, at a lower peak of the tracked allocator.
if story recompute "build/bin/loom run examples/memory/recompute.toml" "${tiny[@]}" \
     --set checkpointing.first=1 &&
   losses=$(steps_ok recompute 3) &&
   grep -qF "checkpointing: full of 1 of 2 units of each of 1 unit list(s) recomputed in backward, and the attention of the other 1" \
     "$work/recompute.log" &&
   story recompute-off "build/bin/loom run examples/memory/recompute.toml" "${tiny[@]}" \
     --set checkpointing.enabled=false &&
   d=$("$python" "$src/tests/support/tensors.py" compare "$work/recompute/checkpoint-3/model.safetensors" \
       "$work/recompute-off/checkpoint-3/model.safetensors" 0) && [[ $d == *bitwise* ]] &&
   "$python" - "$work/recompute/metrics.jsonl" "$work/recompute-off/metrics.jsonl" <<'PY'; then
import json, sys
peak = [max(json.loads(l)["mem_peak_bytes"] for l in open(f)) for f in sys.argv[1:]]
assert peak[0] < peak[1], peak
PY
  ok "activation checkpointing (full + attention on the others): losses $losses, weights bitwise those without it, a lower peak"
else fail "activation checkpointing: ${d:-} $(grep -v '^\s*$' "$work/recompute.log" "$work/recompute-off.log" 2>/dev/null | tail -3)"; fi

# --- 11: the long fp16 run, saving every step in the background (save_total_limit 3), with an
# overflow storm forced by a first loss scale no gradient survives: 2 overflowing steps in a row
# (fallback_after = 2) switch it to this machine's fallback mode; the job's own command again,
# for 2 more steps, goes on in that mode from its newest checkpoint.
storm=(--set precision.init_scale=3e38 --set precision.fallback_after=2 --set train.save_steps=1)
if story long-run "build/bin/loom run examples/reliability/long_run.toml" "${tiny[@]}" "${storm[@]}" \
     --set train.max_steps=4 &&
   losses=$(steps_ok long-run 4) &&
   [ "$(grep -c "saved checkpoint $work/long-run/checkpoint-[123] (in the background" "$work/long-run.log")" -eq 3 ] &&
   fallen=$("$python" - "$work/long-run" <<'PY'
import json, sys
run = sys.argv[1]
rows = [json.loads(l) for l in open(run + "/metrics.jsonl")]
switch = [[k for k in r if k.startswith("precision_fallback_to_")] for r in rows]
assert switch[0] == [] and len(switch[1]) == 1 and switch[2:] == [[], []], switch
mode = switch[1][0].rsplit("_", 1)[1]
values = json.load(open(run + "/checkpoint-4/manifest.json"))["values"]
assert values["precision.mode"] == mode and values["precision.fallback_from"] == "fp16" and \
    values["precision.fallback_step"] == "2", values
print(mode)
PY
   ) &&
   [ "$(ls -d "$work"/long-run/checkpoint-* | xargs -n1 basename | tr '\n' ' ')" = "checkpoint-2 checkpoint-3 checkpoint-4 " ] &&
   timeout 300 "${cmd[@]}" "${tiny[@]}" "${storm[@]}" --set train.max_steps=6 \
     --set "train.output_dir=$work/long-run" >"$work/long-run-again.log" 2>&1 &&
   steps_ok long-run 6 >/dev/null &&
   grep -q "resumed from $work/long-run/checkpoint-4 at step 4" "$work/long-run-again.log" &&
   grep -qF "the checkpoint's run fell back from fp16 to $fallen at step 2" "$work/long-run-again.log" &&
   ! grep -q "precision_fallback_to_" <(tail -2 "$work/long-run/metrics.jsonl"); then
  ok "long fp16 run: losses $losses, saves in the background, fell back to $fallen at step 2 (metrics, manifest); run again, it goes on in $fallen"
else fail "long fp16 run: $(grep -v '^\s*$' "$work/long-run.log" "$work/long-run-again.log" 2>/dev/null | tail -3)"; fi

# --- 12: the hang-debugging job on 2 ranks: as written, a healthy run; with the test's chaos
# plugin skipping one collective on rank 1 at step 2, both ranks name both calls at once,
# well before its 30 s timeout, and the job exits non-zero.
hang="build/bin/loom-launch --nproc-per-node 2 build/bin/loom run examples/distributed/debug_hang.toml"
if story debug-hang "$hang" "${tiny[@]}" && losses=$(steps_ok debug-hang 3); then
  ok "hang debugging on 2 ranks, check_collectives on: losses $losses"
else fail "hang debugging: $(grep -v '^\s*$' "$work/debug-hang.log" | tail -3)"; fi
began=$SECONDS
export LOOM_PLUGIN_PATH=$build/tests/plugins  # the chaos plugin, for this run only
if ! story debug-hang-skip "$hang" "${tiny[@]}" --set 'chaos.mode="skip_collective"' \
       --set chaos.step=2 &&
   [ $((SECONDS - began)) -lt 30 ] &&
   grep -qE "rank 0: \[distributed\] check_collectives: collective #[0-9]+ of group world differs between ranks: rank 0 calls all_gather #[0-9]+ \(3 int64\), rank 1 calls all_reduce" "$work/debug-hang-skip.log" &&
   grep -qE "rank 1: \[distributed\] check_collectives: .* rank 1 calls all_reduce #[0-9]+ .*, rank 0 calls all_gather" "$work/debug-hang-skip.log"; then
  ok "a collective skipped on rank 1: both ranks name both calls in $((SECONDS - began)) s"
else fail "hang debugging, a skipped collective ($((SECONDS - began)) s): $(grep -m2 'error' "$work/debug-hang-skip.log")"; fi
unset LOOM_PLUGIN_PATH

# --- 13: optimizer in backward, as written (dropout 0.1 and all): the weights after 3 steps are
# bitwise those of the same run with it off, at a lower peak of the tracked allocator.
if story in-backward "build/bin/loom run examples/memory/optimizer_in_backward.toml" "${tiny[@]}" &&
   losses=$(steps_ok in-backward 3) &&
   story in-backward-off "build/bin/loom run examples/memory/optimizer_in_backward.toml" "${tiny[@]}" \
     --set train.optimizer_in_backward=false &&
   d=$("$python" "$src/tests/support/tensors.py" compare "$work/in-backward/checkpoint-3/model.safetensors" \
       "$work/in-backward-off/checkpoint-3/model.safetensors" 0) && [[ $d == *bitwise* ]] &&
   "$python" - "$work/in-backward/metrics.jsonl" "$work/in-backward-off/metrics.jsonl" <<'PY'; then
import json, sys
peak = [max(json.loads(l)["mem_peak_bytes"] for l in open(f)) for f in sys.argv[1:]]
assert peak[0] < peak[1], peak
PY
  ok "optimizer in backward: losses $losses, weights bitwise those without it, a lower peak"
else fail "optimizer in backward: ${d:-} $(grep -v '^\s*$' "$work/in-backward.log" "$work/in-backward-off.log" 2>/dev/null | tail -3)"; fi

# --- 14: hybrid sharding, the 4-rank 2 x 2 story on 2 ranks as 2 groups of 1 (the same code
# path: a shard group, the all-reduce across groups; tests/distributed/hsdp_test.sh runs 2 x 2):
# every step reports its cross-group elements, the log names the groups, the checkpoint
# consolidates.
if story hsdp "build/bin/loom-launch --nproc-per-node 4 build/bin/loom run examples/distributed/hsdp.toml" \
     --ranks 2 "${tiny[@]}" "${shard_all[@]}" --set zero.shard_group_size=1 --set train.log_level=info &&
   losses=$(steps_ok hsdp 3 zero_cross_group_elements) &&
   grep -q "shard group 0 of 2 replicas" "$work/hsdp.log" &&
   "$build/bin/loom" consolidate "$work/hsdp/checkpoint-3" "$work/hsdp.safetensors" >/dev/null 2>&1; then
  ok "hybrid sharding on 2 ranks as 2 x 1: losses $losses, cross-group elements every step, a checkpoint that consolidates"
else fail "hybrid sharding: $(grep -v '^\s*$' "$work/hsdp.log" | tail -3)"; fi

# --- 15: bf16 optimizer state, as written (full_bf16 weights): finite losses, the moments saved
# as bf16 in the optimizer file, 4 B/param of state in the log's model line.
if story bf16-state "build/bin/loom run examples/memory/bf16_state.toml" "${tiny[@]}" \
     --set train.log_level=info &&
   losses=$(steps_ok bf16-state 3) &&
   grep -q "optimizer state .* (4.00 B/param)" "$work/bf16-state.log" &&
   "$python" - "$work/bf16-state/checkpoint-3/optimizer-00000-of-00001.safetensors" <<'PY'; then
import sys
from safetensors import safe_open
# "np": the dtypes from the header, without importing torch (~4 s of CPU)
with safe_open(sys.argv[1], "np") as f:
    moments = [k for k in f.keys() if k.startswith("state/")]
    assert moments and all(f.get_slice(k).get_dtype() == "BF16" for k in moments), moments
PY
  ok "bf16 optimizer state: losses $losses, bf16 moments in the checkpoint, 4 B/param of state"
else fail "bf16 optimizer state: $(grep -v '^\s*$' "$work/bf16-state.log" | tail -3)"; fi

# --- 20: bf16 weights without fp32 masters, as written: finite losses, no masters in the
# checkpoint, 8 B/param of model state in the precision's log line.
if story bf16-no-masters "build/bin/loom run examples/memory/bf16_no_masters.toml" "${tiny[@]}" \
     --set train.log_level=info &&
   losses=$(steps_ok bf16-no-masters 3) &&
   grep -q "no masters (the weights updated with stochastic rounding) .* = 8 B" "$work/bf16-no-masters.log" &&
   "$python" - "$work/bf16-no-masters/checkpoint-3/optimizer-00000-of-00001.safetensors" <<'PY'; then
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], "np") as f:
    keys = list(f.keys())
    assert keys and not [k for k in keys if k.startswith("master/")], keys
PY
  ok "bf16 weights without masters: losses $losses, no masters in the checkpoint, 8 B/param"
else fail "bf16 weights without masters: $(grep -v '^\s*$' "$work/bf16-no-masters.log" | tail -3)"; fi
# ... and its ZeRO-3 command on 2 ranks: no masters in either rank's shard, the formula's bytes.
if story bf16-no-masters-zero3 "build/bin/loom-launch --nproc-per-node 2 build/bin/loom run examples/memory/bf16_no_masters.toml --set zero.stage=3" \
     --ranks 2 "${tiny[@]}" --set train.log_level=info &&
   losses=$(steps_ok bf16-no-masters-zero3 3) &&
   grep -q "no masters (bf16 weights rounded stochastically)" "$work/bf16-no-masters-zero3.log" &&
   grep -q "by ZeRO's formula (stage 3, N = 2, 2 B weights and grads, K = 4 B" "$work/bf16-no-masters-zero3.log" &&
   "$python" - "$work/bf16-no-masters-zero3/checkpoint-3" <<'PY'; then
import glob, sys
from safetensors import safe_open
shards = sorted(glob.glob(sys.argv[1] + "/optimizer-*-of-00002.safetensors"))
assert len(shards) == 2, shards
for shard in shards:
    with safe_open(shard, "np") as f:
        keys = list(f.keys())
        assert keys and not [k for k in keys if k.startswith("master/")], keys
PY
  ok "bf16 weights without masters, ZeRO-3 on 2 ranks: losses $losses, no masters in either shard"
else fail "bf16 weights without masters, ZeRO-3: $(grep -v '^\s*$' "$work/bf16-no-masters-zero3.log" | tail -3)"; fi
# ... and its file's one-GPU offload at stage 0, on NVMe so that this CPU moves the state: the
# store holds the moments alone, the swap file gone after.
no_masters_swap=$work/no-masters-swap
mkdir -p "$no_masters_swap"
if story bf16-no-masters-nvme "build/bin/loom run examples/memory/bf16_no_masters.toml" "${tiny[@]}" \
     --set train.log_level=info --set zero.stage=0 \
     --set "zero.offload_optimizer={device=\"nvme\", nvme_path=\"$no_masters_swap\"}" &&
   losses=$(steps_ok bf16-no-masters-nvme 3 offload_bytes_read) &&
   grep -q "offload: optimizer state of .* (bf16 weights as their own masters: none kept)" "$work/bf16-no-masters-nvme.log" &&
   [ -z "$(ls -A "$no_masters_swap")" ]; then
  ok "bf16 weights without masters, stage 0 on NVMe: losses $losses, the moments alone in the swap file"
else fail "bf16 weights without masters, stage 0 on NVMe: $(grep -v '^\s*$' "$work/bf16-no-masters-nvme.log" | tail -3)"; fi

# --- 19: 8-bit Adam: finite losses, the state's bytes in the log, and in the checkpoint each
# tensor of at least min_8bit_size elements as uint8 codes with fp32 absmaxes (one per block),
# the smaller ones as fp32 moments.
if story adam8bit "build/bin/loom run examples/memory/adam8bit.toml" "${tiny[@]}" \
     --set train.log_level=info &&
   losses=$(steps_ok adam8bit 3) &&
   grep -q "optimizer state .* B/param" "$work/adam8bit.log" &&
   "$python" - "$work/adam8bit/checkpoint-3/optimizer-00000-of-00001.safetensors" <<'PY'; then
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], "np") as f:  # "np": the header's dtypes and shapes, no torch
    keys = set(f.keys())
    codes = sorted(k for k in keys if k.endswith("/exp_avg_q"))
    assert codes, sorted(keys)
    for k in codes:
        name = k[: -len("/exp_avg_q")]
        elements = f.get_slice(k).get_shape()[0]
        assert elements >= 4096, (k, elements)
        assert f.get_slice(k).get_dtype() == "U8" and f.get_slice(name + "/exp_avg_sq_q").get_dtype() == "U8"
        blocks = f.get_slice(name + "/exp_avg_absmax").get_shape()[0]
        assert f.get_slice(name + "/exp_avg_absmax").get_dtype() == "F32" and blocks == -(-elements // 256), (name, blocks)
    small = [k for k in keys if k.endswith("/exp_avg")]
    assert small and all(f.get_slice(k).get_dtype() == "F32" and f.get_slice(k).get_shape()[0] < 4096
                         for k in small), small
PY
  ok "8-bit Adam: losses $losses, uint8 codes with fp32 absmaxes in the checkpoint, small tensors in fp32"
else fail "8-bit Adam: $(grep -v '^\s*$' "$work/adam8bit.log" | tail -3)"; fi

# --- 17: the delayed update, on NVMe so that this CPU runs its code path (the job's host store is
# a GPU run's): finite losses with the offload metrics, the log saying the updates run late, the
# swap file gone after.
delayed_swap=$work/delayed-swap
mkdir -p "$delayed_swap"
if story delayed "build/bin/loom run examples/offload/delayed_update.toml" "${tiny[@]}" \
     --set train.log_level=info --set precision.mode=fp32 \
     --set "zero.offload_optimizer={device=\"nvme\", nvme_path=\"$delayed_swap\", delayed_update=true}" &&
   losses=$(steps_ok delayed 3 offload_update_s) &&
   grep -q "one step late" "$work/delayed.log" && [ -z "$(ls -A "$delayed_swap")" ]; then
  ok "delayed update: losses $losses, the updates one step late, no swap file after"
else fail "delayed update: $(grep -v '^\s*$' "$work/delayed.log" | tail -3)"; fi

# --- 18: one GPU, the weights and the optimizer in host memory (stage 3, offload_param and
# offload_optimizer on "cpu"). The job as written is for a GPU: `loom check` takes it here; its
# CPU twin (LOOM_OFFLOAD_CPU_STORE=1, Note [Parameter offload twin]) runs the GPU's staging at
# tiny scale: finite losses, every unit's shard fetched ahead, the log saying it is the twin.
if out=$("$build/bin/loom" check examples/offload/one_gpu_llama_1b.toml 2>&1); then
  ok "loom check one_gpu_llama_1b.toml (device cuda) on this machine"
else fail "check one_gpu_llama_1b.toml: $(tail -3 <<<"$out")"; fi
export LOOM_OFFLOAD_CPU_STORE=1
if story gpu-offload "build/bin/loom run examples/offload/one_gpu_llama_1b.toml" \
     --set 'train.device="cpu"' --set train.max_steps=3 --set train.per_device_train_batch_size=2 \
     --set train.save_steps=0 --set train.logging_steps=1 --set train.progress_bar=false \
     --set train.log_level=info --set data.seq_len=32 --set model.hidden_size=32 \
     --set model.intermediate_size=64 --set model.num_hidden_layers=2 \
     --set model.num_attention_heads=2 --set model.num_key_value_heads=1 \
     --set zero.stage3_param_persistence_threshold=0 &&
   losses=$(steps_ok gpu-offload 3 offload_param_reads_ahead) &&
   grep -q "staged as on a GPU (the CPU twin)" "$work/gpu-offload.log" &&
   grep -q "optimizer state and fp32 masters offloaded to host memory" "$work/gpu-offload.log"; then
  ok "one GPU, weights and optimizer in host memory, its CPU twin: losses $losses"
else fail "one GPU offload twin: $(grep -v '^\s*$' "$work/gpu-offload.log" | tail -3)"; fi
# ... and without fp32 masters, as the file's comment offers: the shards updated where they live.
if story gpu-offload-no-masters "build/bin/loom run examples/offload/one_gpu_llama_1b.toml" \
     --set 'train.device="cpu"' --set train.max_steps=3 --set train.per_device_train_batch_size=2 \
     --set train.save_steps=0 --set train.logging_steps=1 --set train.progress_bar=false \
     --set train.log_level=info --set data.seq_len=32 --set model.hidden_size=32 \
     --set model.intermediate_size=64 --set model.num_hidden_layers=2 \
     --set model.num_attention_heads=2 --set model.num_key_value_heads=1 \
     --set zero.stage3_param_persistence_threshold=0 --set 'optimizer.master_dtype="bf16"' &&
   losses=$(steps_ok gpu-offload-no-masters 3 offload_param_reads_ahead) &&
   grep -q "optimizer state (no fp32 masters: the bf16 weights are their own) offloaded to host memory" \
     "$work/gpu-offload-no-masters.log"; then
  ok "one GPU offload twin without fp32 masters: losses $losses"
else fail "one GPU offload twin without masters: $(grep -v '^\s*$' "$work/gpu-offload-no-masters.log" | tail -3)"; fi
unset LOOM_OFFLOAD_CPU_STORE

echo "$passed passed, $failed failed in $((SECONDS - start)) s"
[ "$failed" -eq 0 ]
