#!/usr/bin/env bash
# The muon rule under ZeRO stages 1-3 with real processes (Note [Muon under ZeRO] in
# plugins/optim/muon.cpp): 2 ranks with batch 2 end with the parameters of 1 process with batch 4
# (20 steps, accumulation 2, clipping; stage 1 over mpi, 2 and 3 over loom-launch's gloo), and
# stage 1 equals plain data parallelism (stage 0) on 2 ranks bit for bit; every matrix's momentum
# buffer lies whole in one rank's optimizer shard, never cut (each matrix orthogonalised whole,
# by its owner). The tiny model of zero_job.toml; parameters compared through `loom consolidate`.
# Then examples/muon.toml by examples/README.md's second command (2 ranks, stage 2) at tiny
# scale: finite losses and the log's line on which tensors went to which rule.
# usage: muon_zero_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
# shellcheck source=testlib.sh
source "$2/tests/distributed/testlib.sh"
ranks_test_setup zero_job.toml "$@"

# adamw_eps 1e-5 for the vectors' AdamW, as zero_test.sh's adamw cases (ddp_job.toml says why);
# the matrices' Newton-Schulz iteration divides by nothing that small. lr 0.02: Muon's steps
# are 0.2 lr in RMS, so the weights move well past the tolerance.
sets=(--set optimizer.name=muon --set optimizer.adamw_eps=1e-5 --set train.learning_rate=0.02)
if ranks none 1 "$work/ref" "${sets[@]}" --set zero.stage=0 \
     --set train.per_device_train_batch_size=4; then
  for stage in 1 2 3; do
    backend=gloo
    [ $stage -eq 1 ] && backend=mpi
    out="$work/s$stage" d=""
    if ranks $backend 2 "$out" "${sets[@]}" --set zero.stage=$stage &&
       d=$(same_params "$work/ref" "$out" 1e-5); then
      ok "muon, stage $stage, 2 ranks over $backend == 1 process x batch 4 ($d)"
    else fail "muon stage $stage ($backend): ${d:-} $(grep -v '^\s*$' "$out.log" | tail -4)"; fi
  done
  if ranks mpi 2 "$work/s0" "${sets[@]}" --set zero.stage=0 &&
     d=$(same_params "$work/s0" "$work/s1" 0); then
    ok "muon, stage 1 == stage 0 (DDP) on 2 ranks ($d)"
  else fail "muon stage 1 vs 0: ${d:-} $(tail -3 "$work/s0.log")"; fi
else fail "muon reference: $(tail -3 "$work/ref.log")"; fi

# Each rank's optimizer shard of the stage-2 run: every momentum buffer (the matrices') is one
# piece of its tensor's whole size, each tensor in exactly one shard.
whole=$("$python" - "$work/s2/checkpoint-20" <<'PY'
import glob, json, sys
shards = sorted(glob.glob(sys.argv[1] + "/optimizer-*-of-*.safetensors"))
owners = {}
for rank, path in enumerate(shards):
    with open(path, "rb") as f:  # the header alone: names and shapes
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    for name, info in header.items():
        if "momentum_buffer" in name:
            owners.setdefault(name, []).append((rank, info["shape"]))
print(len(shards), "shards;", ", ".join(f"{n}: rank {v[0][0]} {v[0][1]}" for n, v in
                                       sorted(owners.items())[:2]), "...")
sys.exit(0 if len(shards) == 2 and len(owners) == 8 and
         all(len(v) == 1 for v in owners.values()) else 1)
PY
) && ok "muon under stage 2: 8 momentum buffers, each whole in one of 2 shards ($whole)" ||
  fail "muon stage 2 shards: $whole"

# examples/muon.toml as examples/README.md shows it, at tiny scale (3 steps, 2 narrow blocks).
port=$((port + 1))
if (cd "$src" && timeout 300 "$launch" --nproc-per-node 2 --master-port $port "$loom" run \
      examples/muon.toml --set zero.stage=2 --set train.max_steps=3 --set train.save_steps=0 \
      --set train.eval_strategy=\"no\" --set data.seq_len=32 --set model.n_layer=2 \
      --set model.n_embd=32 --set model.n_head=2 --set train.logging_steps=1 \
      --set train.progress_bar=false --set "train.output_dir=$work/example") \
      >"$work/example.log" 2>&1 &&
   grep -q "muon: 8 matrices" "$work/example.log" &&
   losses=$("$python" -c "
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '\"loss\"' in l]
assert [r['step'] for r in rows] == [1, 2, 3] and all(math.isfinite(r['loss']) for r in rows)
print(' '.join(f\"{r['loss']:.4f}\" for r in rows))" "$work/example/metrics.jsonl"); then
  split=$(grep -o 'muon: 8 matrices[^;]*' "$work/example.log" | head -1)
  ok "examples/muon.toml on 2 ranks at stage 2, tiny: losses $losses; $split"
else fail "examples/muon.toml: $(grep -v '^\s*$' "$work/example.log" | tail -4)"; fi

echo "passed $passed, failed $failed"
[ "$failed" -eq 0 ]
