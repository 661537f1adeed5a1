# Shared by the multi-process test scripts (sourced): counting results, a bad input's check, runs
# of N ranks and the comparison of their final weights.
passed=0 failed=0
# The first master port of a script's loom-launch runs (each run takes the next): below the
# kernel's ephemeral range (32768 and up here, ip_local_port_range), where the ranks' own
# outgoing connections take their ports and a master port chosen there can be found in use.
port=$((10000 + RANDOM % 20000))
ok() { echo "ok: $1"; passed=$((passed + 1)); }
fail() { echo "FAIL: $1"; failed=$((failed + 1)); }
# ranks_test_setup JOB BUILD_DIR SOURCE_DIR PYTHON: the start of a script whose runs are loom
# jobs on several ranks (call it with the script's own arguments: `ranks_test_setup ddp_job.toml
# "$@"`): sets build, src, python, loom, launch, job (tests/distributed/JOB) and work (a fresh
# temporary folder that cleanup_work removes on exit), puts the test plugins (chaos) on
# LOOM_PLUGIN_PATH, and lets mpirun run as root with more ranks than cores.
ranks_test_setup() {
  build=$2 src=$3 python=$4
  loom=$build/bin/loom launch=$build/bin/loom-launch
  job=$src/tests/distributed/$1
  work=$(mktemp -d)
  trap cleanup_work EXIT
  export LOOM_PLUGIN_PATH=$build/tests/plugins
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
}
# The EXIT trap's cleanup: the temporary folder $work goes, but after a failure its runs' logs
# are kept first (in $build/Testing/failed-logs/SCRIPT.PID, named in the output), so a failure
# that does not repeat can still be read.
cleanup_work() {
  if [ "${failed:-0}" -gt 0 ] && [ -d "${work:-}" ]; then
    local keep; keep=$build/Testing/failed-logs/$(basename "$0" .sh).$$
    mkdir -p "$keep" && (cd "$work" && find . -name '*.log' -exec cp --parents {} "$keep" \;)
    echo "the runs' logs are kept in $keep"
  fi
  rm -rf "$work"
  kill $(jobs -p) 2>/dev/null
}
# expect_error NAME TEXT COMMAND...: COMMAND fails (not by timeout) and says TEXT.
expect_error() {
  local name=$1 text=$2; shift 2
  local out; out=$("$@" 2>&1); local rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -qF -- "$text" <<<"$out"; then ok "$name"; else
    fail "$name (exit $rc): $(tail -3 <<<"$out")"; fi
}
# ranks BACKEND N OUT [--set ...]: a run of $job on N ranks (N = 1: one plain process), its
# output in OUT.log; uses $loom, $launch and $port (each loom-launch run takes the next port).
ranks() {
  local backend=$1 n=$2 out=$3; shift 3
  if [ "$n" -eq 1 ]; then
    timeout 300 "$loom" run "$job" --set "train.output_dir=$out" "$@" >"$out.log" 2>&1
  elif [ "$backend" = mpi ]; then
    timeout 300 mpirun --oversubscribe --bind-to none -x LOOM_PLUGIN_PATH -np "$n" \
      "$loom" run "$job" --set "train.output_dir=$out" "$@" >"$out.log" 2>&1
  else
    port=$((port + 1))
    timeout 300 "$launch" --nproc-per-node "$n" --master-port $port \
      "$loom" run "$job" --set "train.output_dir=$out" "$@" >"$out.log" 2>&1
  fi
}
# same_params A B TOLERANCE [STEP]: the final weights of two runs' checkpoint-STEP (20), fp32
# masters where a run kept them, through `loom consolidate` (once per run and step: a reference
# run is compared many times); prints the worst relative difference (tests/support/tensors.py:
# numpy, not torch, whose import would cost seconds per comparison).
# Most runs compared keep their whole model in model.safetensors, in fp32, and no fp32 masters
# beside it (one process, DDP, stages 0-2 of fp32 weights): there `loom consolidate` would write
# exactly that file's tensors (checked bitwise when this was written), so the file is linked in
# place of the consolidated one, sparing a loom process (~1-2 s of start-up) per run. A model
# file marked partial (stage 3, placed experts: Note [Partial model files]) or holding half
# weights, or a shard holding masters, is consolidated as before, so `loom consolidate` still
# builds the model of every stage-3, expert-parallel and bf16 run compared.
safetensors_header() {  # FILE: the JSON header (the 8-byte little-endian length, then the text)
  local n; n=$(od -An -t u8 -N8 "$1") && head -c $((8 + n)) "$1" | tail -c +9
}
whole_fp32_model() {  # CHECKPOINT
  [ -f "$1/model.safetensors" ] &&
    ! safetensors_header "$1/model.safetensors" | grep -qE 'loom_partial|"(BF16|F16)"' &&
    ! { for shard in "$1"/optimizer-*.safetensors; do
          [ -e "$shard" ] && safetensors_header "$shard"; done | grep -q 'master/'; }
}
consolidated() {  # RUN STEP: RUN.cSTEP.safetensors, made on first use
  local file=$1.c$2.safetensors checkpoint=$1/checkpoint-$2
  [ -e "$file" ] && return 0
  if whole_fp32_model "$checkpoint"; then ln -s "$checkpoint/model.safetensors" "$file"
  else "$loom" consolidate "$checkpoint" "$file" >/dev/null; fi
}
same_params() {
  consolidated "$1" "${4:-20}" && consolidated "$2" "${4:-20}" &&
  "$python" "$src/tests/support/tensors.py" compare "$1.c${4:-20}.safetensors" "$2.c${4:-20}.safetensors" "$3"
}
# same_checkpoint_files A B: two checkpoint folders hold the same files, every safetensors file
# byte for byte (the weights or their pieces, masters, optimizer and trainer state), and manifests
# that agree but for what names the job itself (its text, its hash, the manifest's checksum);
# prints "N files byte for byte". For two runs whose state has the same layout (same world size,
# stage and shard groups) this checks what same_params ... 0 checks and more: `loom consolidate`
# builds its model from these files and the manifest alone (core/src/checkpoint_io.cpp), so
# equal inputs give the same model, and no loom process (~1 s of start-up each on 2 cores) runs
# per run and step compared.
same_checkpoint_files() {
  if [ ! -f "$1/manifest.json" ] || [ "$(cd "$1" && echo *)" != "$(cd "$2" && echo *)" ]; then
    echo "different files: $(cd "$1" && echo *) vs $(cd "$2" && echo *)"; return 1
  fi
  local file n=0
  for file in "$1"/*.safetensors; do
    cmp -s "$file" "$2/${file##*/}" || { echo "${file##*/} differs"; return 1; }
    n=$((n + 1))
  done
  "$python" - "$1/manifest.json" "$2/manifest.json" <<'PY' || return 1
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
for m in (a, b):
    for key in ("job", "config_hash", "manifest_crc32"):
        m.pop(key, None)
if a != b:
    print("the manifests differ in", ", ".join(k for k in sorted(a | b) if a.get(k) != b.get(k)))
    sys.exit(1)
PY
  echo "$n files byte for byte"
}
