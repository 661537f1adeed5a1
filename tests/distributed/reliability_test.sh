#!/usr/bin/env bash
# Pre-emption and leftovers with real processes and signals (Note [Graceful stop], Note [One
# run per output_dir]):
# - SIGTERM during a step: the run finishes that step, writes a checkpoint, exits 143; the
#   resumed run ends bitwise equal to an uninterrupted one (one process, and 2 ranks under
#   loom-launch with the signal sent to the launcher);
# - a run with nothing to save exits 143 without a checkpoint;
# - kill -9 during a save leaves a `.checkpoint-N.tmp` folder; the resume removes it;
# - Note [Asynchronous checkpoints]: saves in the background are byte-identical to synchronous
#   ones; a save step that finds the previous save still writing waits and says so once; a
#   kill -9 mid-save leaves the last committed checkpoint, and the resume from it is bitwise
#   the uninterrupted run; SIGTERM with a save in flight commits it before the signal's save;
#   async_save not a bool is an error naming it;
# - a second run on an output_dir in use is refused, naming the first run;
# - kill -9 of loom-launch: every rank is gone within 5 s.
# usage: reliability_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
# shellcheck source=testlib.sh
source "$2/tests/distributed/testlib.sh"
ranks_test_setup ddp_job.toml "$@"

# same_model A B: two checkpoints' model.safetensors are bitwise equal.
same_model() {
  local d; d=$("$python" "$src/tests/support/tensors.py" compare "$1/model.safetensors" "$2/model.safetensors" 0) &&
    [[ $d == *bitwise* ]]
}

# --- one process: SIGTERM during step 7's backward (the chaos plugin), save_steps = 5
sets=(--set train.max_steps=12 --set train.save_steps=5 --set train.log_level=info)
timeout 120 "$loom" run "$job" --set "train.output_dir=$work/whole" "${sets[@]}" >"$work/whole.log" 2>&1
timeout 120 "$loom" run "$job" --set "train.output_dir=$work/term" "${sets[@]}" \
  --set chaos.mode='"sigterm"' --set chaos.rank=0 \
  --set chaos.step=7 >"$work/term.log" 2>&1
rc=$?
if [ $rc -eq 143 ] && [ -f "$work/term/checkpoint-7/manifest.json" ] && [ ! -d "$work/term/checkpoint-12" ] &&
   grep -q "stopped by SIGTERM after step 7 of 12" "$work/term.log"; then
  ok "SIGTERM in step 7: the step finished, checkpoint-7 written, exit 143"
else fail "SIGTERM in step 7 (exit $rc): $(ls "$work/term") $(tail -3 "$work/term.log")"; fi
timeout 120 "$loom" run "$job" --set "train.output_dir=$work/term" "${sets[@]}" \
  --set train.resume='"latest"' >"$work/term-resume.log" 2>&1 &&
  same_model "$work/whole/checkpoint-12" "$work/term/checkpoint-12" &&
  ok "the resumed run ends bitwise equal to the uninterrupted one" ||
  fail "resume after SIGTERM: $(tail -3 "$work/term-resume.log")"

# --- Note [Asynchronous checkpoints], one process. same_checkpoint A B: every file of two
# checkpoint folders byte-identical (cmp), but manifest.json, whose recorded job names another
# output_dir (and async_save): the rest of it equal as JSON, its own checksum aside.
same_checkpoint() {
  [ "$(ls "$1")" = "$(ls "$2")" ] || { echo "files differ: $(ls "$1" | tr '\n' ' ') / $(ls "$2" | tr '\n' ' ')"; return 1; }
  for f in "$1"/*; do
    [ "$(basename "$f")" = manifest.json ] || cmp "$f" "$2/$(basename "$f")" || return 1
  done
  "$python" - "$1/manifest.json" "$2/manifest.json" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
for m in (a, b):
    del m["job"], m["manifest_crc32"]
sys.exit(0 if a == b else f"manifests differ: {a} / {b}")
PY
}
# The same job saving in the background: checkpoints 5 and 10 (written by the writer thread)
# and 12 (the final one) are the synchronous run's, byte for byte.
timeout 120 "$loom" run "$job" --set "train.output_dir=$work/async" "${sets[@]}" \
  --set train.async_save=true >"$work/async.log" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "saved checkpoint $work/async/checkpoint-10 (in the background" "$work/async.log" &&
   same_checkpoint "$work/whole/checkpoint-5" "$work/async/checkpoint-5" &&
   same_checkpoint "$work/whole/checkpoint-10" "$work/async/checkpoint-10" &&
   same_checkpoint "$work/whole/checkpoint-12" "$work/async/checkpoint-12"; then
  ok "async_save: checkpoints 5, 10 (background) and 12 byte-identical to the synchronous run's"
else fail "async_save vs synchronous (exit $rc): $(tail -3 "$work/async.log")"; fi
# A writer held 4 s after its files (a test knob): save steps 5 and 10 come sooner, so step 10
# waits for checkpoint-5 (said once), commits it and starts checkpoint-10; a kill -9 while
# checkpoint-10's files lie in .checkpoint-10.tmp without a manifest leaves checkpoint-5 as the
# last checkpoint; the resume from it removes the leftover and ends bitwise the uninterrupted run.
LOOM_TEST_ASYNC_SAVE_DELAY_MS=4000 "$loom" run "$job" --set "train.output_dir=$work/akill" "${sets[@]}" \
  --set train.async_save=true >"$work/akill.log" 2>&1 &
victim=$!
killed=0
for _ in $(seq 300); do
  if [ -f "$work/akill/checkpoint-5/manifest.json" ] && [ -f "$work/akill/.checkpoint-10.tmp/model.safetensors" ]; then
    kill -9 $victim && killed=1; break
  fi
  sleep 0.05
done
wait $victim 2>/dev/null
waits=$(grep -c "step 10: checkpoint-5 is still being written in the background; training waits for it" "$work/akill.log")
if [ $killed -eq 1 ] && [ "$waits" -eq 1 ] && [ ! -d "$work/akill/checkpoint-10" ] && [ ! -d "$work/akill/checkpoint-12" ]; then
  ok "async_save: step 10 waited for checkpoint-5 (said once); kill -9 mid-save left checkpoint-5 the last"
else fail "async_save kill (killed $killed, wait lines $waits): $(ls -a "$work/akill" | tr '\n' ' ') $(tail -3 "$work/akill.log")"; fi
timeout 120 "$loom" run "$job" --set "train.output_dir=$work/akill" "${sets[@]}" --set train.async_save=true \
  --set train.resume='"latest"' >"$work/akill-resume.log" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "resumed from $work/akill/checkpoint-5 at step 5" "$work/akill-resume.log" &&
   grep -q "removed $work/akill/.checkpoint-10.tmp: a checkpoint save that never finished" "$work/akill-resume.log" &&
   same_checkpoint "$work/whole/checkpoint-12" "$work/akill/checkpoint-12"; then
  ok "async_save: the resume from checkpoint-5 ends byte-identical to the uninterrupted run"
else fail "resume after an async kill (exit $rc): $(tail -3 "$work/akill-resume.log")"; fi
# SIGTERM in step 7 while checkpoint-5 is still being written: the run waits for it, commits
# it, writes checkpoint-7 and exits 143; both are the synchronous SIGTERM run's, byte for byte.
LOOM_TEST_ASYNC_SAVE_DELAY_MS=1500 timeout 120 "$loom" run "$job" --set "train.output_dir=$work/aterm" \
  "${sets[@]}" --set train.async_save=true --set chaos.mode='"sigterm"' --set chaos.rank=0 \
  --set chaos.step=7 >"$work/aterm.log" 2>&1
rc=$?
if [ $rc -eq 143 ] && grep -q "stopped by SIGTERM after step 7 of 12" "$work/aterm.log" &&
   same_checkpoint "$work/term/checkpoint-5" "$work/aterm/checkpoint-5" &&
   same_checkpoint "$work/term/checkpoint-7" "$work/aterm/checkpoint-7"; then
  ok "async_save: SIGTERM with checkpoint-5 in flight: committed, checkpoint-7 written, exit 143"
else fail "async_save SIGTERM (exit $rc): $(ls -a "$work/aterm" | tr '\n' ' ') $(tail -3 "$work/aterm.log")"; fi
# The wait is said once per run however often it happens (steps 2 and 3 here).
LOOM_TEST_ASYNC_SAVE_DELAY_MS=300 timeout 120 "$loom" run "$job" --set "train.output_dir=$work/await" \
  --set train.max_steps=4 --set train.save_steps=1 --set train.async_save=true >"$work/await.log" 2>&1
rc=$?
if [ $rc -eq 0 ] && [ "$(grep -c "training waits for it" "$work/await.log")" -eq 1 ] &&
   [ "$(ls -d "$work"/await/checkpoint-* | wc -l)" -eq 4 ]; then
  ok "async_save: waits for the previous save said once; checkpoints 1-4 all written"
else fail "async_save waits (exit $rc): $(ls -a "$work/await" | tr '\n' ' ') $(tail -3 "$work/await.log")"; fi
expect_error "async_save not a bool" "[train] async_save must be boolean, not 3" \
  timeout 60 "$loom" run "$job" --set "train.output_dir=$work/abad" --set train.async_save=3

# --- nothing to save: the stop is still clean, exit 143, no checkpoint
timeout 120 "$loom" run "$job" --set "train.output_dir=$work/nosave" --set train.max_steps=12 \
  --set train.save_final=false --set chaos.mode='"sigterm"' \
  --set chaos.rank=0 --set chaos.step=3 >"$work/nosave.log" 2>&1
rc=$?
if [ $rc -eq 143 ] && ! ls "$work/nosave" | grep -q checkpoint; then
  ok "SIGTERM in a job that saves nothing: exit 143, no checkpoint"
else fail "SIGTERM without saving (exit $rc): $(ls -a "$work/nosave") $(tail -3 "$work/nosave.log")"; fi

# --- one stop delivered twice within milliseconds (Slurm signals every process of a step;
# `timeout` its child and then its group) is one request: the run still saves
"$loom" run "$job" --set "train.output_dir=$work/twice" --set train.max_steps=100000 \
  >"$work/twice.log" 2>&1 &
pid=$!
for _ in $(seq 300); do [ -s "$work/twice/metrics.jsonl" ] && break; sleep 0.1; done
kill -TERM $pid; kill -TERM $pid
wait $pid
rc=$?
if [ $rc -eq 143 ] && ls -d "$work"/twice/checkpoint-* >/dev/null 2>&1; then
  ok "SIGTERM delivered twice at once: one stop, a checkpoint, exit 143"
else fail "SIGTERM twice (exit $rc): $(ls "$work/twice") $(tail -3 "$work/twice.log")"; fi

# --- 2 ranks under loom-launch, SIGTERM to the launcher mid-run: both ranks stop after the
# same step, one checkpoint, exit 143; the resume is bitwise the uninterrupted 2-rank run.
# The signal goes to `timeout`, which passes it on twice (to the launcher, then its group).
sets=(--set train.max_steps=300 --set train.save_steps=100 --set train.log_level=info)
port=$((port + 1))
timeout 300 "$launch" --nproc-per-node 2 --master-port $port "$loom" run "$job" \
  --set "train.output_dir=$work/whole2" "${sets[@]}" >"$work/whole2.log" 2>&1
port=$((port + 1))
timeout 300 "$launch" --nproc-per-node 2 --master-port $port "$loom" run "$job" \
  --set "train.output_dir=$work/term2" "${sets[@]}" >"$work/term2.log" 2>&1 &
launcher=$!
for _ in $(seq 600); do [ -d "$work/term2/checkpoint-100" ] && break; sleep 0.1; done
kill -TERM $launcher
wait $launcher
rc=$?
stopped=$(grep -o "stopped by SIGTERM after step [0-9]*" "$work/term2.log" | sort -u)
if [ $rc -eq 143 ] && [ "$(grep -c "stopped by SIGTERM" "$work/term2.log")" -eq 2 ] &&
   [ "$(wc -l <<<"$stopped")" -eq 1 ]; then
  step=${stopped##* }
  if [ -f "$work/term2/checkpoint-$step/manifest.json" ]; then
    ok "SIGTERM to loom-launch: both ranks stopped after step $step, checkpoint written, exit 143"
  else fail "SIGTERM to loom-launch: no checkpoint-$step: $(ls "$work/term2")"; fi
else fail "SIGTERM to loom-launch (exit $rc): ${stopped:-no stop} $(tail -4 "$work/term2.log")"; fi
port=$((port + 1))
timeout 300 "$launch" --nproc-per-node 2 --master-port $port "$loom" run "$job" \
  --set "train.output_dir=$work/term2" "${sets[@]}" --set train.resume='"latest"' \
  >"$work/term2-resume.log" 2>&1 &&
  same_model "$work/whole2/checkpoint-300" "$work/term2/checkpoint-300" &&
  ok "2 ranks: the resumed run ends bitwise equal to the uninterrupted one" ||
  fail "2-rank resume after SIGTERM: $(tail -3 "$work/term2-resume.log")"

# --- kill -9 during a save (every step saves a 4 MB model), then resume: no temp folder left
big=(--set model.n_embd=256 --set model.n_layer=4 --set model.n_head=4 --set train.save_steps=1
     --set train.max_steps=400 --set train.save_total_limit=2)
"$loom" run "$job" --set "train.output_dir=$work/k9" "${big[@]}" >"$work/k9.log" 2>&1 &
victim=$!  # loom itself: a kill of a `timeout` wrapper would leave it running
"$python" - "$work/k9" $victim <<'PY'
import os, signal, sys, time
folder, pid = sys.argv[1], int(sys.argv[2])
deadline = time.time() + 100
while time.time() < deadline:
    try:
        if any(n.startswith(".checkpoint-") and n.endswith(".tmp") for n in os.listdir(folder)):
            os.kill(pid, signal.SIGKILL)
            break
    except FileNotFoundError:
        pass
PY
wait $victim 2>/dev/null
left=$(cd "$work/k9" && ls -d .checkpoint-*.tmp 2>/dev/null)
if [ -n "$left" ]; then
  timeout 120 "$loom" run "$job" --set "train.output_dir=$work/k9" "${big[@]}" \
    --set train.max_steps=2 --set train.resume='"latest"' --set train.log_level=info >"$work/k9-resume.log" 2>&1
  rest=$(cd "$work/k9" && ls -d .checkpoint-*.tmp 2>/dev/null)
  if [ -z "$rest" ] && grep -q "a checkpoint save that never finished" "$work/k9-resume.log"; then
    ok "kill -9 during a save left $left; the resume removed it"
  else fail "temp folder after resume: ${rest:-none left} $(tail -3 "$work/k9-resume.log")"; fi
else fail "kill -9 during a save: no temp folder seen ($(ls -a "$work/k9" | tr '\n' ' '))"; fi

# --- a second run on an output_dir in use is refused; kill -9 of loom-launch takes its ranks
port=$((port + 1))
"$launch" --nproc-per-node 2 --master-port $port "$loom" run "$job" \
  --set "train.output_dir=$work/busy" --set train.max_steps=100000 --set train.save_final=false \
  >"$work/busy.log" 2>&1 &
launcher=$!
for _ in $(seq 300); do [ -f "$work/busy/metrics.jsonl" ] && break; sleep 0.1; done
expect_error "a second run on the same output_dir is refused, naming the first" \
  "is in use by another loom run (pid" \
  timeout 60 "$loom" run "$job" --set "train.output_dir=$work/busy" --set train.resume='"latest"'
ranks=$(pgrep -P $launcher | tr '\n' ' ')
kill -9 $launcher
gone=0
for _ in $(seq 50); do
  alive=0
  for pid in $ranks; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [ $alive -eq 0 ] && { gone=1; break; }
  sleep 0.1
done
if [ -n "$ranks" ] && [ $gone -eq 1 ]; then ok "kill -9 of loom-launch: its ranks ($ranks) were gone within 5 s"
else fail "kill -9 of loom-launch: ranks '$ranks' still alive after 5 s"; kill -9 $ranks 2>/dev/null; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
