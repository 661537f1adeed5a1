#!/usr/bin/env bash
# Builds the fuzz targets (tests/fuzz, clang's libFuzzer with AddressSanitizer and UBSan) and
# runs each over its committed corpus plus RUNS fresh inputs: any crash, sanitizer report or
# exception other than loom's own error fails the test. Skipped (77) without clang's fuzzer
# runtime. The long runs behind docs/RELIABILITY.md: RUNS=10000000.
# usage: fuzz_test.sh SOURCE_DIR BUILD_DIR [RUNS]
set -uo pipefail
src=$1 build=$2/fuzz runs=${3:-${RUNS:-20000}}
command -v clang++ >/dev/null || { echo "skip: clang++ is not installed (scripts/setup installs it)"; exit 77; }
# Through ccache where it is installed, in loom's own cache (scripts/build's): a fresh build
# folder (a CI run's) takes the sanitized objects of unchanged sources from the cache instead of
# compiling them again (~100 s of CPU); a changed source compiles afresh. The paths in
# the compile commands are made relative to the source tree (CCACHE_BASEDIR, as scripts/build
# does, and the prefix map of tests/fuzz/CMakeLists.txt), so a clone at another path hits too.
launcher=$(command -v ccache || true)
if [ -n "$launcher" ]; then
  CCACHE_BASEDIR=$(cd "$src" && pwd)
  export CCACHE_DIR=${CCACHE_DIR:-${LOOM_CACHE:-$HOME/.cache/loom}/ccache} CCACHE_BASEDIR
fi
cmake -S "$src/tests/fuzz" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher} \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$build.log" 2>&1 && cmake --build "$build" >>"$build.log" 2>&1 ||
  { tail -20 "$build.log"; echo "FAIL: the fuzz targets do not build"; exit 1; }
status=0
for target in job safetensors manifest; do
  corpus=$(mktemp -d)
  cp "$src/tests/fuzz/corpus/$target"/* "$corpus/"
  if "$build/fuzz_$target" -runs="$runs" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
       -print_final_stats=1 "$corpus" >"$build/$target.log" 2>&1; then
    echo "ok: fuzz_$target: $(grep -o 'stat::number_of_executed_units: [0-9]*' "$build/$target.log" | cut -d' ' -f2) executions, no crash"
  else
    tail -30 "$build/$target.log"
    echo "FAIL: fuzz_$target found a crash (the input is in $build)"
    status=1
  fi
  rm -rf "$corpus"
done
exit $status
