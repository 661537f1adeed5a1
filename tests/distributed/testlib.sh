# Shared by the multi-process test scripts (sourced): counting results, and a bad input's check.
passed=0 failed=0
ok() { echo "ok: $1"; passed=$((passed + 1)); }
fail() { echo "FAIL: $1"; failed=$((failed + 1)); }
# expect_error NAME TEXT COMMAND...: COMMAND fails (not by timeout) and says TEXT.
expect_error() {
  local name=$1 text=$2; shift 2
  local out; out=$("$@" 2>&1); local rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -qF -- "$text" <<<"$out"; then ok "$name"; else
    fail "$name (exit $rc): $(tail -3 <<<"$out")"; fi
}
