#!/usr/bin/env bash
# End-to-end test of the `loom` command: the demo job for a few steps (loss falls, metrics
# written, checkpoint made), `check`, `plugins`, and bad input (one clear error line, non-zero
# exit, nothing half-written).
# usage: cli_test.sh LOOM_BINARY SOURCE_DIR PYTHON
set -uo pipefail
loom=$1 src=$2 python=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
ok() { echo "ok: $1"; passed=$((passed + 1)); }
fail() { echo "FAIL: $1"; failed=$((failed + 1)); }
# expect_error NAME EXPECTED_TEXT COMMAND...: exit code 1 and the text on stderr.
expect_error() {
  local name=$1 text=$2; shift 2
  local err
  err=$("$@" 2>&1 >/dev/null); local rc=$?
  if [ $rc -eq 1 ] && grep -qF -- "$text" <<<"$err"; then ok "$name"; else
    fail "$name (exit $rc): $err"; fi
}

# Output is captured first: `loom ... | grep -q` would fail under pipefail once grep stops
# reading early and loom gets SIGPIPE.
out=$("$loom" --version); grep -q "^loom 0.1.0" <<<"$out" && ok "--version" || fail "--version"
out=$("$loom" --help); grep -q "loom run JOB.toml" <<<"$out" && ok "--help" || fail "--help"
out=$("$loom" plugins); grep -q "^gpt 0.1.0" <<<"$out" && ok "plugins lists gpt" || fail "plugins lists gpt"
for job in "$src"/examples/*.toml; do
  "$loom" check "$job" >/dev/null && ok "check $(basename "$job")" || fail "check $job"
done

# The demo job, shortened.
out="$work/demo"
if "$loom" run "$src/examples/demo.toml" --set train.max_steps=40 --set "train.output_dir=$out" \
     --set train.resume= --set train.save_steps=0 >"$work/demo.log" 2>&1; then
  ok "demo runs"
else
  fail "demo runs: $(tail -5 "$work/demo.log")"
fi
grep -q "intra-op threads" "$work/demo.log" && ok "header prints the thread count" \
  || fail "header prints the thread count"
lines=$(wc -l <"$out/metrics.jsonl" 2>/dev/null || echo 0)
[ "$lines" -eq 40 ] && ok "metrics.jsonl has 40 lines" || fail "metrics.jsonl has $lines lines"
"$python" - "$out/metrics.jsonl" <<'PY' && ok "loss falls and metrics have every field" || fail "loss falls"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
need = {"step", "loss", "lr", "samples_per_s", "tokens_per_s", "mem_current_bytes", "mem_peak_bytes"}
assert all(need <= set(r) for r in rows), rows[0]
first = sum(r["loss"] for r in rows[:5]) / 5
last = sum(r["loss"] for r in rows[-5:]) / 5
print(f"loss {first:.3f} -> {last:.3f}")
assert last < first - 1.0, (first, last)
PY
[ -f "$out/checkpoint-40/manifest.json" ] && ok "final checkpoint written" || fail "final checkpoint"

# Bad input.
printf '[train]\nmodel = "gpt"\nmax_step = 3\n' >"$work/typo.toml"
expect_error "unknown key" "typo.toml:3: unknown key 'max_step' in [train]; did you mean 'max_steps'?" \
  "$loom" run "$work/typo.toml"
expect_error "missing job" "cannot read job file" "$loom" run "$work/none.toml"
expect_error "unknown plugin" "[lorra] names no known plugin" \
  "$loom" check "$src/examples/demo.toml" --set lorra.r=4
expect_error "unknown command" "unknown command 'rnu'" "$loom" rnu
bad_out="$work/bad-data"
expect_error "missing data file" "cannot read '/nonexistent/text.txt'" \
  "$loom" run "$src/examples/demo.toml" --set "data.path=/nonexistent/text.txt" \
  --set "train.output_dir=$bad_out" --set train.resume=
[ -z "$(ls -A "$bad_out" 2>/dev/null | grep -v metrics.jsonl)" ] && ok "nothing written after a bad start" \
  || fail "files left after a bad start: $(ls -A "$bad_out")"
# A corrupted checkpoint is refused on resume and left as it was.
model="$out/checkpoint-40/model.safetensors"
printf 'XXXX' | dd of="$model" bs=1 seek=200 conv=notrunc status=none
before=$(sha256sum "$model")
expect_error "corrupt checkpoint" "is corrupt: crc32" \
  "$loom" run "$src/examples/demo.toml" --set train.max_steps=41 --set "train.output_dir=$out" \
  --set train.resume=latest
[ "$before" = "$(sha256sum "$model")" ] && ok "corrupt checkpoint untouched" || fail "checkpoint changed"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
