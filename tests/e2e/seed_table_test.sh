#!/usr/bin/env bash
# Runs the seed-table benchmark in its tiny size: all nine configurations must produce a row
# with numbers, the memory ordering the seed shows for adafactor and 8-bit Adam must hold, and
# the chart must be written.
# usage: seed_table_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -euo pipefail
build=$1 src=$2 python=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" "$src/examples/bench/seed_table/run.py" --tiny --loom "$build/bin/loom" \
  --chart "$work/chart.png" >"$work/table.md" 2>"$work/log.txt" || { cat "$work/log.txt"; exit 1; }
"$python" - "$work/table.md" <<'PY'
import re, sys
rows = [l for l in open(sys.argv[1]) if l.startswith("| ") and not l.startswith("| configuration")]
assert len(rows) == 9, f"{len(rows)} rows:\n" + "".join(rows)
mem = {}
for row in rows:
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    assert all(re.fullmatch(r"[0-9.]+", c) for c in cells[1:9]), row
    mem[cells[0]] = float(cells[3])
print("ok: nine rows, every cell a number")
# Optimizer state: adafactor and 8-bit Adam need less memory than AdamW at batch 4.
assert mem["adafactor, batch 4"] < mem["vanilla, batch 4"], mem
assert mem["8-bit Adam, batch 4"] < mem["vanilla, batch 4"], mem
print("ok: adafactor and 8-bit Adam use less memory than vanilla")
PY
test -s "$work/chart.png" && echo "ok: chart written"
echo "3 passed, 0 failed"
