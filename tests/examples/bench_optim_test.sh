#!/usr/bin/env bash
# loom_bench_optim compare's bad inputs: each gives a message naming the input and what to use,
# and a non-zero exit; a size that would time adam8bit's fp32-state path is said so on stderr.
# usage: bench_optim_test.sh LOOM_BENCH_OPTIM
set -u
bench=$1
failures=0
# expect RC WANTED COMMAND...: COMMAND exits with RC (or non-zero for "fail") and prints WANTED.
expect() {
  local rc_want=$1 want=$2
  shift 2
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if { [ "$rc_want" = fail ] && [ "$rc" -eq 0 ]; } || { [ "$rc_want" != fail ] && [ "$rc" -ne "$rc_want" ]; }; then
    echo "FAIL: '$*' exited $rc (wanted $rc_want); it printed: $out"
    failures=$((failures + 1))
  elif ! grep -qF -- "$want" <<< "$out"; then
    echo "FAIL: '$*' did not print '$want'; it printed: $out"
    failures=$((failures + 1))
  fi
}
for step in abc 0 -3 1.5; do
  expect fail "LOOM_BENCH_OPTIM_FIRST_STEP='$step' is not a step number: use a whole number from 1" \
    env LOOM_BENCH_OPTIM_FIRST_STEP="$step" "$bench" compare 1 1 0.2 torch-fused
done
expect fail "PARAMS_MILLIONS 0.050000 makes empty tensors: use at least 0.1024" \
  "$bench" compare 1 1 0.05 torch-fused
expect fail "ISA 'avx1024' is not avx512, avx2 or scalar" \
  "$bench" compare 1 1 0.2 adam8bit:avx1024
expect 0 "adam8bit: tensors of 1024 elements are below its min_8bit_size (4096)" \
  "$bench" compare 1 1 0.2 adam8bit
# A valid first step runs and reports its rounds.
expect 0 '"entry": "adam8bit"' env LOOM_BENCH_OPTIM_FIRST_STEP=20000 "$bench" compare 1 1 0.5 adam8bit
if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "loom_bench_optim: every bad input refused with its message"
