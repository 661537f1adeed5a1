#!/usr/bin/env bash
# A relocatable SDK and out-of-tree plugins: installs loom into a temporary prefix, moves the
# prefix, runs the moved `loom` without LD_LIBRARY_PATH, builds examples/third_party_plugin (ema
# and hello, five lines of CMake) against the moved package with LibTorch found through
# LOOM_PYTHON (no path of this build in the package's CMake files), and trains with both through
# the installed `loom`: the EMA of the weights equals torch's AveragedModel fed the checkpoint of
# every step, and a resume continues the average.
# usage: third_party_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -euo pipefail
build=$1 src=$2 python=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
mv "$work/prefix" "$work/moved"
# The moved install runs without LD_LIBRARY_PATH: its run paths hold $ORIGIN (loom's libraries
# and plugins) and the real folder of the build's venv (LibTorch), nothing of the build tree.
# torch's package folder and its CMake prefix (torch.utils.cmake_prefix_path: share/cmake in
# it) found without importing torch, whose import costs ~4 s of CPU.
torch_dir=$("$python" -c "import importlib.util; print(importlib.util.find_spec('torch').submodule_search_locations[0])")
torch_lib=$(realpath "$torch_dir/lib")
torch_prefix=$torch_dir/share/cmake
[ -d "$torch_lib" ] && [ -f "$torch_prefix/Torch/TorchConfig.cmake" ] ||
  { echo "FAIL: no LibTorch under $torch_dir"; exit 1; }
for file in "$work/moved/bin/loom" "$work/moved/lib/libloom_core.so" \
            "$work/moved/lib/loom/plugins/loom_gpt.so"; do
  runpath=$(readelf -d "$file" | sed -n 's/.*(R\(UN\)\{0,1\}PATH).*\[\(.*\)\]/\2/p')
  IFS=: read -ra entries <<<"$runpath"
  for entry in "${entries[@]}"; do
    if [[ $entry != '$ORIGIN'* && $entry != "$torch_lib" ]]; then
      echo "FAIL: ${file#"$work/"} looks for libraries in $entry"; exit 1
    fi
  done
done
echo "ok: the installed files' run paths are \$ORIGIN/... and $torch_lib"
moved_loom() { env -u LD_LIBRARY_PATH "$work/moved/bin/loom" "$@"; }
version=$(moved_loom --version)
grep -q "^loom 0.1.0" <<<"$version"
checked=$(moved_loom check "$src/examples/demo.toml")
grep -q "ok: the job is valid" <<<"$checked"
listing=$(moved_loom plugins)
grep -q "file: $work/moved/lib/loom/plugins/loom_gpt.so" <<<"$listing"
if grep -q "FAILED TO LOAD" <<<"$listing"; then grep -A2 "FAILED TO LOAD" <<<"$listing"; exit 1; fi
echo "ok: the moved loom runs without LD_LIBRARY_PATH (--version, check; plugins from its lib/)"
if grep -rqF "$torch_prefix" "$work/moved/lib/cmake"; then
  echo "FAIL: the installed CMake files name this machine's torch ($torch_prefix)"; exit 1
fi
echo "ok: the installed CMake package names no path of this build's LibTorch"
if LOOM_PYTHON= cmake -S "$src/examples/third_party_plugin" -B "$work/none" -G Ninja \
     -DCMAKE_PREFIX_PATH="$work/moved" >"$work/none.log" 2>&1; then
  echo "FAIL: configured without any way to find LibTorch"; exit 1
fi
grep -q "LOOM_PYTHON to a" "$work/none.log"
echo "ok: without LibTorch the package says how to point at it"
# The plugins compile through ccache where it is installed, as loom's own build does, with
# this temporary folder as ccache's base directory (the SDK's include path inside it is hashed
# relative to it): a run after one with the same sources and SDK headers takes the two objects
# from the cache, byte for byte what the compiler would write, instead of parsing LibTorch's
# headers again (a third of this test's time on 2 cores); the link against the moved
# libraries is done every time. A changed header or source compiles afresh.
launcher=${CMAKE_CXX_COMPILER_LAUNCHER:-$(command -v ccache || true)}
export CCACHE_BASEDIR=$work
LOOM_PYTHON=$python cmake -S "$src/examples/third_party_plugin" -B "$work/plugins" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/moved" -DCMAKE_BUILD_TYPE=Release \
  ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher} >/dev/null
cmake --build "$work/plugins" >/dev/null
test -f "$work/plugins/loom_ema.so" && test -f "$work/plugins/loom_hello.so"
echo "ok: built loom_ema.so and loom_hello.so against the moved SDK"
loom=$work/moved/bin/loom
listing=$("$loom" plugins --path "$work/plugins")
grep -q "^hello 1.0.0" <<<"$listing" && grep -q "^ema 1.0.0" <<<"$listing"
echo "ok: the installed loom lists them"
# Note [Job plugin paths]: a job's [plugins] path loads code only when the user allows it.
out=$("$loom" check "$src/examples/demo.toml" --set "plugins.path=$work/plugins" 2>&1 || true)
grep -q "would load plugins from folders this job file names" <<<"$out"
grep -q -- "--allow-job-plugins, or set LOOM_ALLOW_JOB_PLUGINS=1" <<<"$out"
checked=$(LOOM_ALLOW_JOB_PLUGINS=1 "$loom" check "$src/examples/demo.toml" \
  --set "plugins.path=$work/plugins" --set hello.every=2)
grep -q "hello 1.0.0: $work/plugins/loom_hello.so" <<<"$checked"
echo "ok: a job's plugin folder is refused unless allowed (flag or LOOM_ALLOW_JOB_PLUGINS=1)"
# The demo's runs here take steps of 4 samples: the plugins' behaviour does not depend on the
# batch, and the demo's 16 made these runs' steps most of their time.
"$loom" run "$src/examples/demo.toml" --allow-job-plugins --set "plugins.path=$work/plugins" \
  --set hello.every=2 --set train.max_steps=4 --set "train.output_dir=$work/run" \
  --set train.per_device_train_batch_size=4 \
  --set train.resume= > "$work/run.log" 2>&1 || { cat "$work/run.log"; exit 1; }
grep -q "hello from a third-party plugin at step 4" "$work/run.log"
grep -q '"hello_greetings":2' "$work/run/metrics.jsonl"
echo "ok: trained with hello (greeting logged, metric written)"
out=$("$loom" run "$src/examples/demo.toml" --allow-job-plugins --set "plugins.path=$work/plugins" --set hello.every=0 --set "train.output_dir=$work/bad" 2>&1 || true)
grep -q "\[hello\] every must be positive, got 0" <<<"$out"
echo "ok: its config error reaches the user"
help=$(LOOM_PLUGIN_PATH=$work/plugins "$loom" --help)
grep -q "loom hello \[NAME\]   greets NAME" <<<"$help"
out=$(LOOM_PLUGIN_PATH=$work/plugins "$loom" hello loom)
[ "$out" = "hello, loom, from a plugin command" ]
out=$(LOOM_PLUGIN_PATH=$work/plugins "$loom" hello a b 2>&1 || true)
grep -q "loom: error: loom hello takes one name at most, got 2" <<<"$out"
out=$("$loom" no-such-command 2>&1 || true)
grep -q "unknown command 'no-such-command'" <<<"$out"
echo "ok: its command is listed by loom --help and runs, its error is loom's one line"

# EMA: 6 steps with a checkpoint after each; then 3 steps, and a resume for 3 more.
ema_run() {  # OUT MAX_STEPS
  LOOM_ALLOW_JOB_PLUGINS=1 "$loom" run "$src/examples/demo.toml" --set "plugins.path=$work/plugins" \
    --set ema.decay=0.8 --set train.per_device_train_batch_size=4 \
    --set train.max_steps="$2" --set train.save_steps=1 --set "train.output_dir=$1" \
    --set train.resume=latest --set train.progress_bar=false >>"$1.log" 2>&1 || { cat "$1.log"; exit 1; }
}
ema_run "$work/ema" 6
ema_run "$work/ema_resumed" 3
ema_run "$work/ema_resumed" 6
"$python" - "$work/ema" "$work/ema_resumed" <<'PY'
import sys
import torch
from safetensors.torch import load_file
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

run, resumed = sys.argv[1], sys.argv[2]
ema = load_file(f"{run}/ema.safetensors")
names = sorted(ema)
holder = torch.nn.Module()
holder.weights = torch.nn.ParameterList(
    [torch.nn.Parameter(torch.zeros_like(ema[n])) for n in names])
average = AveragedModel(holder, multi_avg_fn=get_ema_multi_avg_fn(0.8))
for step in range(1, 7):
    weights = load_file(f"{run}/checkpoint-{step}/model.safetensors")
    with torch.no_grad():
        for p, n in zip(holder.weights, names):
            p.copy_(weights[n])
    average.update_parameters(holder)
worst = max(float((ema[n] - a.detach()).abs().max()) for n, a in zip(names, average.module.weights))
assert worst < 1e-6, f"ema differs from AveragedModel by {worst}"
other = load_file(f"{resumed}/ema.safetensors")
assert all(torch.equal(other[n], ema[n]) for n in names), "the resumed run's average differs"
print(f"ema of {len(names)} tensors equals AveragedModel's (worst {worst:.1e}); the resumed run's is bitwise")
PY
echo "ok: the EMA equals torch's AveragedModel over the checkpoints, and resumes bitwise"
echo "11 passed, 0 failed"
