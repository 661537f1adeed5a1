#!/usr/bin/env bash
# Hang reports (Note [Hang reports] in core/src/comm_trace.cpp), two ranks of the tiny model over
# gloo under loom-launch, [distributed] timeout_seconds = 5 where a run waits the timeout out
# (10 where the error must come before it):
# - rank 1 stopped by SIGSTOP mid-run: rank 0's error names rank 1, the collective it did not
#   reach and its last one, within the timeout and a few seconds, and the job exits non-zero;
# - a collective skipped on one rank (the chaos plugin's skip_collective mode) with
#   [distributed] check_collectives = true: the error names both ranks' calls at once, long
#   before the timeout; without the check, the hang report names the diverged rank;
# - check_collectives on a healthy run changes nothing: bitwise the same weights;
# - the mpi backend (when mpirun exists): a stopped rank is reported through the trace files.
# usage: hang_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
# shellcheck source=testlib.sh
source "$2/tests/distributed/testlib.sh"
ranks_test_setup ddp_job.toml "$@"

# rank_pid OUTPUT_DIR RANK: the pid of the loom process of the run writing OUTPUT_DIR whose
# environment says it is RANK (loom-launch sets RANK; mpirun OMPI_COMM_WORLD_RANK). Only that
# run's processes have OUTPUT_DIR on their command line.
rank_pid() {
  local pid
  for pid in $(pgrep -f "train.output_dir=$1( |$)"); do
    [ "$(readlink "/proc/$pid/exe")" = "$(readlink -f "$loom")" ] || continue
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null |
       grep -qxE "(RANK|OMPI_COMM_WORLD_RANK)=$2"; then echo "$pid"; return; fi
  done
}

# stop_and_wait LAUNCHER_PID RANK_PID: stops the rank (SIGSTOP), waits up to 90 s for the
# launcher to end, then ends the stopped rank; sets rc (the launcher's exit) and elapsed (s).
stop_and_wait() {
  local parent=$1 victim=$2
  kill -STOP "$victim"
  local start=$SECONDS
  while kill -0 "$parent" 2>/dev/null && [ $((SECONDS - start)) -lt 90 ]; do sleep 0.2; done
  elapsed=$((SECONDS - start))
  kill -9 "$parent" 2>/dev/null
  wait "$parent"; rc=$?
  kill -CONT "$victim" 2>/dev/null; kill -9 "$victim" 2>/dev/null
}

# The runs that wait out the timeout take 5 s: three such waits were half of this script's
# time at 10 s. 5 s is still twice the hang report's own read gap (2.5 s) and far above a
# healthy step of the tiny model (milliseconds) on a loaded 2-core machine, and both ranks start
# together under one launcher (the SIGSTOP runs stop a rank only after 20 steps).
wait_out=5
long=(--set train.max_steps=1000000 --set train.save_final=false --set train.logging_steps=1
      --set distributed.timeout_seconds=$wait_out)

# --- SIGSTOP of rank 1 under loom-launch (gloo)
port=$((port + 1))
"$launch" --nproc-per-node 2 --master-port $port "$loom" run "$job" \
  --set "train.output_dir=$work/stop" "${long[@]}" >"$work/stop.log" 2>&1 &
launcher=$!
for _ in $(seq 600); do [ "$(cat "$work/stop/metrics.jsonl" 2>/dev/null | wc -l)" -ge 20 ] && break; sleep 0.1; done
victim=$(rank_pid "$work/stop" 1)
if [ -z "$victim" ]; then fail "SIGSTOP: rank 1's pid not found under loom-launch ($launcher)"; else
  stop_and_wait $launcher "$victim"
  # The error: "rank 0: all_reduce #N (... float32) of group world failed: ...; rank 1 did not
  # reach all_reduce #N (...): its last collective was OP #M (...); it has been silent ..."
  # or, when rank 1 was stopped inside collectives already started (ddp's buckets), "rank 1
  # reached all_reduce #N (...) (its last collective was OP #M ..., not finished); it has been
  # silent ..."
  line=$(grep -m1 "loom: error: rank 0: " "$work/stop.log")
  if [ $rc -ne 0 ] && [ $rc -ne 137 ] && [ "$elapsed" -le $((wait_out + 15)) ] &&
     grep -qE "rank 0: [a-z_]+ #[0-9]+ \([0-9]+ [a-z0-9]+\) of group world failed: .*; rank 1 (did not reach|reached) [a-z_]+ #[0-9]+ \([0-9]+ [a-z0-9]+\)(: | \()its last collective was [a-z_]+ #[0-9]+.*; it has been silent for 2.5 s \(stopped, or dead\)" <<<"$line" &&
     grep -q "the last collectives of group world here:" "$work/stop.log"; then
    ok "SIGSTOP of rank 1: rank 0 names it in ${elapsed} s (timeout $wait_out s), exit $rc: $(cut -c1-60 <<<"${line#*; }")"
  else fail "SIGSTOP of rank 1 (exit $rc, ${elapsed} s): ${line:-$(tail -3 "$work/stop.log")}"; fi
  # The numbers agree: the collective named is the one rank 0 waited in, and rank 1's last one
  # comes before it when rank 1 did not reach it, at or after it when it did.
  waited=$(grep -oE "rank 0: [a-z_]+ #[0-9]+" <<<"$line" | grep -oE "[0-9]+$")
  named=$(grep -oE "rank 1 (did not reach|reached) [a-z_]+ #[0-9]+" <<<"$line" | grep -oE "[0-9]+$")
  last=$(grep -oE "its last collective was [a-z_]+ #[0-9]+" <<<"$line" | grep -oE "[0-9]+$")
  if [ -n "$waited" ] && [ "$waited" = "$named" ] && [ -n "$last" ] &&
     { { grep -q "did not reach" <<<"$line" && [ "$last" -lt "$waited" ]; } ||
       { grep -q "rank 1 reached" <<<"$line" && [ "$last" -ge "$waited" ]; }; }; then
    ok "the report's numbers agree: waited in #$waited, rank 1's last #$last"
  else fail "the report's numbers: waited '$waited', named '$named', last '$last'"; fi
fi

# --- a collective skipped on rank 1 at step 3, with check_collectives: named at once (one run
# for the three checks: it fails, before the 10 s timeout, and both ranks name both calls)
port=$((port + 1)) start=$SECONDS
out=$(timeout 120 "$launch" --nproc-per-node 2 --master-port $port "$loom" run "$job" \
  --set "train.output_dir=$work/skip" --set 'chaos.mode="skip_collective"' --set chaos.step=3 \
  --set distributed.check_collectives=true --set distributed.timeout_seconds=10 2>&1); rc=$?
took=$((SECONDS - start))
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -qF -- "differs between ranks: rank 0 calls all_gather #" <<<"$out"; then
  ok "skipped collective, check_collectives: both ranks' calls named"
else fail "skipped collective, check_collectives (exit $rc): $(tail -3 <<<"$out")"; fi
[ $took -lt 10 ] && ok "the mismatch was found in $took s, before the 10 s timeout" ||
  fail "the mismatch took $took s"
# Rank 0 all-gathers 3 int64 as collective #N; rank 1, which skipped it, is at its next call.
if grep -qE "rank 0: \[distributed\] check_collectives: collective #[0-9]+ of group world differs between ranks: rank 0 calls all_gather #[0-9]+ \(3 int64\), rank 1 calls all_reduce #[0-9]+ \([0-9]+ [a-z0-9]+\) [a-z]+ — the ranks took different paths" <<<"$out" &&
   grep -qE "rank 1: \[distributed\] check_collectives: .* rank 1 calls all_reduce #[0-9]+ .*, rank 0 calls all_gather #[0-9]+ \(3 int64\)" <<<"$out"; then
  ok "both ranks name both calls: $(grep -oE 'rank 0 calls all_gather[^—]*' <<<"$out" | head -1)"
else fail "check_collectives messages: $(grep 'check_collectives' <<<"$out" | head -2)"; fi

# --- the same divergence without the check: the hang report names where rank 1 is
start=$SECONDS
out=$(timeout 120 "$launch" --nproc-per-node 2 --master-port $((port += 1)) "$loom" run "$job" \
  --set "train.output_dir=$work/skip3" --set 'chaos.mode="skip_collective"' --set chaos.step=3 \
  --set distributed.timeout_seconds=$wait_out 2>&1); rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $((SECONDS - start)) -lt $((wait_out + 30)) ] &&
   grep -qE "rank 1 called all_reduce #[0-9]+ \([0-9]+ [a-z0-9]+\) where this rank called all_gather #[0-9]+ \(3 int64\): the ranks took different paths|rank 0 called all_gather #[0-9]+ \(3 int64\) where this rank called|rank [01] is ahead, at" <<<"$out"; then
  ok "without the check, the timeout's report names the diverged rank (exit $rc, $((SECONDS - start)) s)"
else fail "divergence without the check (exit $rc, $((SECONDS - start)) s): $(grep 'error' <<<"$out" | tail -2)"; fi

# --- check_collectives on a healthy run: the same weights, bitwise
ranks gloo 2 "$work/plain" && ranks gloo 2 "$work/checked" --set distributed.check_collectives=true &&
  d=$(same_params "$work/plain" "$work/checked" 0) && grep -q bitwise <<<"$d" &&
  ok "check_collectives on a healthy run: bitwise the same weights" ||
  fail "healthy run with check_collectives: ${d:-} $(tail -3 "$work/checked.log")"

# --- mpi: a stopped rank, reported through the trace files in output_dir
if command -v mpirun >/dev/null; then
  mpirun --oversubscribe --bind-to none -x LOOM_PLUGIN_PATH -np 2 "$loom" run "$job" \
    --set "train.output_dir=$work/mpistop" --set 'distributed.backend="mpi"' "${long[@]}" \
    >"$work/mpistop.log" 2>&1 &
  runner=$!
  # As with gloo above: rank 1 stopped before the collective ("did not reach"), or inside ddp's
  # bucket all-reduces it had already started ("reached ... not finished"); both name it.
  for _ in $(seq 600); do [ "$(cat "$work/mpistop/metrics.jsonl" 2>/dev/null | wc -l)" -ge 20 ] && break; sleep 0.1; done
  victim=$(rank_pid "$work/mpistop" 1)
  if [ -z "$victim" ]; then fail "mpi SIGSTOP: rank 1's pid not found under mpirun ($runner)"; else
    stop_and_wait $runner "$victim"
    if [ $rc -ne 0 ] && [ "$elapsed" -le $((wait_out + 20)) ] &&
       grep -qE "rank 0: MPI [a-z_]+ #[0-9]+ .* of group world did not complete within $wait_out s; rank 1 (did not reach|reached) [a-z_]+ #[0-9]+ .*; it has been silent" "$work/mpistop.log"; then
      ok "mpi: SIGSTOP of rank 1 named through the trace files in ${elapsed} s (exit $rc)"
    else fail "mpi SIGSTOP (exit $rc, ${elapsed} s): $(grep -m1 'error' "$work/mpistop.log") $(tail -2 "$work/mpistop.log")"; fi
  fi
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
