#!/usr/bin/env bash
# Fault injection on what loom reads: damaged checkpoints and hostile job files each end in one
# clear error naming the file and field, a non-zero exit, and no hang (every run is bounded by
# `timeout`: exit 124 is a hang); runs that diverge stop with an error and write no checkpoint.
# usage: faults_test.sh LOOM_BINARY SOURCE_DIR PYTHON
set -uo pipefail
loom=$1 src=$2 python=$3
job=$src/tests/distributed/ddp_job.toml
work=$(mktemp -d)
trap 'rm -rf "$work"; kill $(jobs -p) 2>/dev/null' EXIT
# shellcheck source=../distributed/testlib.sh
source "$src/tests/distributed/testlib.sh"

base=(--set train.max_steps=4 --set train.log_level=warn)
timeout 120 "$loom" run "$job" --set "train.output_dir=$work/good" "${base[@]}" >"$work/good.log" 2>&1 ||
  { echo "FAIL: the reference run: $(tail -3 "$work/good.log")"; exit 1; }

# damage NAME PYTHON_CODE [NAME PYTHON_CODE]...: for each NAME a copy of the good run whose
# checkpoint-4 the code changes (`ck`: its folder; `fix_manifest()` re-records every file's size
# and crc32, so only the damage itself is left to catch). One Python process makes them all:
# the damages written with the reference safetensors writer import torch, ~4 s of CPU each time.
damage() {
  local args=()
  while [ $# -ge 2 ]; do
    rm -rf "$work/$1"; cp -r "$work/good" "$work/$1"
    args+=("$work/$1/checkpoint-4" "$2"); shift 2
  done
  "$python" - "${args[@]}" <<'PY'
import sys
HELPERS = r"""
import json, os, sys, zlib
def manifest():
    return json.load(open(ck + "/manifest.json"))
def seal(m):  # Note [Manifest checksum]: crc32 of the rest, compact, keys sorted
    rest = {k: v for k, v in m.items() if k != "manifest_crc32"}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return zlib.crc32(text.encode())
def write_raw(m):  # an edit that leaves the manifest's own checksum as it was
    json.dump(m, open(ck + "/manifest.json", "w"), indent=2)
def write(m):  # a careful editor: the manifest's own checksum made to match
    m["manifest_crc32"] = seal(m)
    write_raw(m)
def fix_manifest():
    m = manifest()
    for name in m["files"]:
        data = open(os.path.join(ck, name), "rb").read()
        m["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    write(m)
"""
for ck, code in zip(sys.argv[1::2], sys.argv[2::2]):
    exec(HELPERS + code, {"ck": ck, "__name__": "damage"})
PY
}
# resume NAME: the damaged copy resumed with more steps.
resume() {
  timeout 60 "$loom" run "$job" --set "train.output_dir=$work/$1" "${base[@]}" \
    --set train.max_steps=8 --set train.resume='"latest"'
}

damage fifo 'os.remove(ck + "/model.safetensors"); os.mkfifo(ck + "/model.safetensors")'
expect_error "model.safetensors replaced by a FIFO: refused, no hang" \
  "model.safetensors' is not a regular file (a FIFO)" resume fifo
damage zero 'os.remove(ck + "/model.safetensors"); os.symlink("/dev/zero", ck + "/model.safetensors")'
expect_error "model.safetensors linked to /dev/zero: refused, no hang" \
  "model.safetensors' is a symbolic link (to '/dev/zero')" resume zero
damage loop 'os.remove(ck + "/model.safetensors"); os.symlink(ck + "/model.safetensors", ck + "/model.safetensors")'
expect_error "model.safetensors a symbolic link to itself (a loop): named" \
  "model.safetensors' is a symbolic link" resume loop
damage elsewhere 'os.rename(ck + "/model.safetensors", ck + "/../model-copy.safetensors"); os.symlink(ck + "/../model-copy.safetensors", ck + "/model.safetensors")'
expect_error "model.safetensors a symbolic link to a good copy elsewhere: refused by name" \
  "model.safetensors' is a symbolic link" resume elsewhere
# Note [Manifest checksum]: any edit of manifest.json that does not also make its own checksum
# match, a field loom never reads included, is refused before any field is read.
damage edited 'm = manifest(); m["loom_version"] = "9.9.9"; write_raw(m)'
expect_error "manifest.json edited (a field loom does not read)" \
  "manifest.json' is corrupt: its content does not match its own checksum" resume edited
damage flipped '
p = ck + "/manifest.json"
data = bytearray(open(p, "rb").read())
at = data.index(b"config_hash") + len(b"config_hash\": \"")
data[at] ^= 0x01  # one bit of the config hash
open(p, "wb").write(data)'
expect_error "one bit flipped in manifest.json" \
  "manifest.json' is corrupt: its content does not match its own checksum" resume flipped
damage unsealed 'm = manifest(); del m["manifest_crc32"]; write_raw(m)'
expect_error "a format 3 manifest without its own checksum" "without its manifest_crc32" \
  resume unsealed
# safetensors refused as the reference reader refuses them, even with every checksum matching.
damage trailing 'open(ck + "/model.safetensors", "ab").write(b"\0" * 16); fix_manifest()'
expect_error "bytes appended after the last tensor of model.safetensors" \
  "model.safetensors' is corrupt: 16 bytes after the last tensor belong to no tensor" resume trailing
damage twice '
p = ck + "/model.safetensors"
data = bytearray(open(p, "rb").read())
n = int.from_bytes(data[:8], "little")
text = data[8:8 + n].decode()
header = json.loads(text)
first, second = sorted((k for k in header if k != "__metadata__"), key=len)[:2]
# the second tensor entry renamed to the first: one name, two entries (same header length)
assert len(first) <= len(second)
renamed = text.replace("\"" + second + "\"", "\"" + first + " " * (len(second) - len(first)) + "\"", 1)
renamed = renamed.replace(first + " " * (len(second) - len(first)) + "\"", first + "\"" + " " * (len(second) - len(first)), 1)
assert len(renamed) == n
data[8:8 + n] = renamed.encode()
open(p, "wb").write(data)
fix_manifest()'
expect_error "one tensor name twice in model.safetensors' header" "twice in one object" resume twice
damage dir 'os.remove(ck + "/trainer.safetensors"); os.mkdir(ck + "/trainer.safetensors")'
expect_error "a directory in place of trainer.safetensors" \
  "trainer.safetensors' is not a regular file (a directory)" resume dir
# The damages that need the reference writer (and so torch), made in one Python process.
retype() {  # DTYPE: a damage's code
  echo "
import safetensors.torch as st, torch
p = ck + '/model.safetensors'
with open(p, 'rb') as f:
    n = int.from_bytes(f.read(8), 'little'); header = json.loads(f.read(n))
name = next(k for k in header if k != '__metadata__')
# A well-formed file (the reference writer's) whose one tensor has another dtype: I32 keeps
# the bytes, the half types the values.
tensors = st.load_file(p)
tensors[name] = {'I32': lambda t: t.view(torch.int32), 'BF16': lambda t: t.to(torch.bfloat16),
                 'F16': lambda t: t.to(torch.float16)}['$1'](tensors[name])
st.save_file(tensors, p, metadata=header.get('__metadata__'))
fix_manifest()"
}
damage dtypeI32 "$(retype I32)" dtypeBF16 "$(retype BF16)" dtypeF16 "$(retype F16)" \
  bigstep1 'm = manifest(); m["step"] = 9223372036854775807; write(m)
import safetensors.torch as st
p = ck + "/optimizer-00000-of-00001.safetensors"
with open(p, "rb") as f:
    n = int.from_bytes(f.read(8), "little"); meta = json.loads(f.read(n))["__metadata__"]
meta["step"] = str(9223372036854775807)
st.save_file(st.load_file(p), p, metadata=meta)
m = manifest(); m["optimizer_shards"][0]["bytes"] = os.path.getsize(p)
m["optimizer_shards"][0]["crc32"] = zlib.crc32(open(p, "rb").read()); write(m)'
for to in I32 BF16 F16; do
  expect_error "a tensor's dtype changed to $to in model.safetensors" "but the model holds Float" \
    resume "dtype$to"
done
damage bigstep 'm = manifest(); m["step"] = 9223372036854775807; write(m)'
expect_error "manifest step 2^63-1: refused (its shards are of step 4)" \
  "is from step 4 but the checkpoint is of step 9223372036854775807" resume bigstep
expect_error "manifest and shards at step 2^63-1: refused, names max_steps" \
  "is at step 9223372036854775807, past this job's [train] max_steps 8" resume bigstep1
damage nocrc 'm = manifest(); del m["files"]["model.safetensors"]["crc32"]; write(m)'
expect_error "manifest without a crc32: names the missing field" \
  "manifest.json' is corrupt: a field is missing (key 'crc32' not found)" resume nocrc
damage cursor 'm = manifest(); m["data"]["cursor"] = -5; write(m)'
expect_error "negative data cursor: a corrupt manifest, not an internal error" \
  "data.cursor is -5, it must be >= 0" resume cursor
damage escape 'm = manifest(); m["files"]["../../escape.safetensors"] = m["files"].pop("model.safetensors"); write(m)'
expect_error "a manifest naming a file outside its folder" \
  "it lists a file '../../escape.safetensors'" resume escape

# --- runs that diverge: an error naming the step, exit 1, no checkpoint of garbage
# diverges NAME STEPS TEXT WHAT: an infinite-going learning rate for STEPS steps.
diverges() {
  timeout 60 "$loom" run "$job" --set "train.output_dir=$work/$1" --set train.max_steps=$2 \
    --set train.learning_rate=1e300 >"$work/$1.log" 2>&1
  local rc=$?
  if [ $rc -eq 1 ] && grep -qF "$3" "$work/$1.log" && ! ls "$work/$1" | grep -q "^checkpoint"; then
    ok "$4: exit 1, the error names the step, no checkpoint written"
  else fail "$4 (exit $rc): $(ls "$work/$1") $(tail -2 "$work/$1.log")"; fi
}
diverges diverge 1 "holds non-finite values at step 1" "an update to infinity"
diverges diverge2 3 "step 2: the loss is nan" "a non-finite loss"

# --- hostile job files: refused in `check`, no crash
"$python" -c "print('x = ' + '[' * 12000 + ']' * 12000)" >"$work/deep.toml"
expect_error "an array nested 12 000 levels deep: refused by check, no stack overflow" \
  "deep.toml:1: the job nests deeper than 64 levels" timeout 30 "$loom" check "$work/deep.toml"
"$python" -c "print('[' + '.'.join(['a'] * 12000) + ']')" >"$work/dotted.toml"
expect_error "a table header 12 000 keys deep" "dotted.toml:1: the job nests deeper" \
  timeout 30 "$loom" check "$work/dotted.toml"
for found in "$src"/tests/fuzz/corpus/job/toml_unreachable_*.toml; do
  expect_error "$(basename "$found") (a TOML++ 3.3 unreachable path, found by fuzzing): a clean error" \
    "$(basename "$found"):1:" timeout 30 "$loom" check "$found"
done
mkfifo "$work/job-fifo.toml"
expect_error "a FIFO as the job file" "is not a regular file" timeout 30 "$loom" check "$work/job-fifo.toml"
for bad in "model.n_head=3 model.n_embd=128|must be divisible by n_head 3" \
           "model.n_layer=0|n_layer must be positive" \
           "data.seq_len=64|seq_len 64 exceeds [model] n_positions 16" \
           "optimizer.weight_decay=-1|weight_decay must be >= 0" \
           "distributed.timeout_seconds=-1|timeout_seconds must be positive" \
           "distributed.timeout_seconds=nan|timeout_seconds must be a finite number" \
           "train.learning_rate=inf|learning_rate must be a finite number" \
           "model.n_layer=100000000|fp32 weights alone need"; do
  sets=() ; for kv in ${bad%%|*}; do sets+=(--set "$kv"); done
  expect_error "check refuses ${bad%%|*}" "${bad##*|}" timeout 30 "$loom" check "$job" "${sets[@]}"
done

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
