#!/usr/bin/env bash
# Installs loom into a temporary prefix, builds examples/third_party_plugin against the
# installed package (find_package(loom)), and trains with it through the installed `loom`.
# usage: third_party_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/examples/third_party_plugin" -B "$work/hello" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release ${CMAKE_CXX_COMPILER_LAUNCHER:+-DCMAKE_CXX_COMPILER_LAUNCHER=$CMAKE_CXX_COMPILER_LAUNCHER} >/dev/null
cmake --build "$work/hello" >/dev/null
test -f "$work/hello/loom_hello.so"
echo "ok: built loom_hello.so against the installed SDK"
listing=$("$work/prefix/bin/loom" plugins --path "$work/hello")
grep -q "^hello 1.0.0" <<<"$listing"
echo "ok: the installed loom lists it"
"$work/prefix/bin/loom" run "$src/examples/demo.toml" --set "plugins.path=$work/hello" \
  --set hello.every=2 --set train.max_steps=4 --set "train.output_dir=$work/run" \
  --set train.resume= > "$work/run.log" 2>&1 || { cat "$work/run.log"; exit 1; }
grep -q "hello from a third-party plugin at step 4" "$work/run.log"
grep -q '"hello_greetings":2' "$work/run/metrics.jsonl"
echo "ok: trained with it (greeting logged, metric written)"
out=$("$work/prefix/bin/loom" run "$src/examples/demo.toml" --set "plugins.path=$work/hello" --set hello.every=0 --set "train.output_dir=$work/bad" 2>&1 || true)
grep -q "\[hello\] every must be positive, got 0" <<<"$out"
echo "ok: its config error reaches the user"
echo "4 passed, 0 failed"
