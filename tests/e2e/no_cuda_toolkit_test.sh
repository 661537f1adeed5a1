#!/usr/bin/env bash
# loom on a machine without the CUDA toolkit (Note [LibTorch without the CUDA toolkit] in
# cmake/LoomFindTorch.cmake). In a private mount namespace, empty folders cover every CUDA
# toolkit on this machine and links to the toolkit's names cover those names in /usr/local and
# /usr (nvcc wrappers, header and library links), the environment loses its CUDA variables and
# PATH entries, and CMake is shown to find no toolkit. There loom configures from scratch, builds
# a program that links LibTorch through loom::torch (tests/e2e/build_probe.cpp) and runs it: the
# GPU code must be compiled out and no CUDA library linked. Then this build's installed package
# builds a third-party plugin there (loomConfig.cmake), which the installed loom lists.
# About 30 s on two cores without ccache (most of it loom's configure and two compiles).
# LOOM_NO_CUDA_FULL=1 also builds the `loom` CLI and the gpt and preload plugins without CUDA
# (7 minutes on two cores: the whole core) and checks and trains a job with them.
# usage: no_cuda_toolkit_test.sh SOURCE_DIR BUILD_DIR PYTHON [COMPILER_LAUNCHER]
set -euo pipefail
src=$1 build=$2 python=$3 launcher=${4:-}

if [ "${LOOM_NO_CUDA_NAMESPACE:-}" != 1 ]; then
  [ "$(id -u)" -eq 0 ] || { echo "skipped: a mount namespace needs root"; exit 77; }
  unshare --mount --propagation private true 2>/dev/null ||
    { echo "skipped: unshare --mount is not allowed here"; exit 77; }
  # This build, configured with whatever toolkit the machine has, still compiles CUDA in where
  # one is (LOOM_CUDA=auto).
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /opt/cuda/bin/nvcc 2>/dev/null |
         head -1 || true)
  want=device=cpu
  if [ -n "$nvcc" ] && "$nvcc" --version >/dev/null 2>&1; then want=device=cuda; fi
  if grep -q "^LOOM_CUDA:STRING=auto$" "$build/CMakeCache.txt"; then
    version=$("$build/bin/loom" --version)
    grep -q "$want" <<<"$version" ||
      { echo "FAIL: this build's loom --version lacks $want: $version"; exit 1; }
    echo "ok: this build (nvcc: ${nvcc:-none}) says $want"
  fi
  # The namespace's mounts live in a folder removed from out here, where they do not exist.
  mounts=$(mktemp -d)
  trap 'rm -rf "$mounts"' EXIT
  rc=0
  LOOM_NO_CUDA_NAMESPACE=1 LOOM_NO_CUDA_MOUNTS=$mounts \
    unshare --mount --propagation private bash "$0" "$@" || rc=$?
  exit $rc
fi

mounts=$LOOM_NO_CUDA_MOUNTS
work=$build/tests/no_cuda_toolkit  # a fixed folder, so ccache serves a rerun
rm -rf "$work"
mkdir -p "$work" "$mounts/empty"

# The toolkits: the real folders behind the names a toolkit goes by.
roots=()
for candidate in /usr/local/cuda /usr/local/cuda-* /opt/cuda /opt/cuda-* /usr/lib/cuda \
                 ${CUDA_HOME:-} ${CUDA_PATH:-} ${CUDA_TOOLKIT_ROOT:-}; do
  [ -d "$candidate" ] || continue
  root=$(realpath "$candidate")
  case $root in / | /usr | /usr/local) continue ;; esac
  [[ " ${roots[*]} " == *" $root "* ]] || roots+=("$root")
done
# Their entries' names by kind (programs, headers, libraries), as links or wrappers in the
# system's folders of that kind would carry them.
declare -A toolkit_names=()
for root in "${roots[@]}"; do
  for sub in bin include lib lib64; do
    kind=${sub%64}
    for entry in "$root/$sub"/*; do
      name=${entry##*/}
      [ -e "$entry" ] && { [ "$kind" != lib ] || [[ $name == lib* ]]; } || continue
      toolkit_names[$kind/$name]=1
    done
  done
done
for root in "${roots[@]}"; do mount --bind "$mounts/empty" "$root"; done

# Covers folder $1 with a folder of links to all its entries but the toolkit's names of kind $2;
# the links go through a read-only view of the folder.
without_toolkit_names() {
  local dir=$1 kind=$2 view=$mounts/views$1 shadow=$mounts/shadows$1 entry name
  mkdir -p "$view" "$shadow"
  mount --bind "$dir" "$view"
  mount -o remount,bind,ro "$view"
  shopt -s nullglob dotglob
  for entry in "$view"/*; do
    name=${entry##*/}
    [ -n "${toolkit_names[$kind/$name]:-}" ] || ln -s "$entry" "$shadow/$name"
  done
  shopt -u nullglob dotglob
  mount --bind "$shadow" "$dir"
}
hidden=()
for dir in /usr/local/bin /usr/local/include /usr/local/lib /usr/bin /usr/include; do
  [ -d "$dir" ] && [ ! -L "$dir" ] || continue
  kind=${dir##*/}
  for name in "${!toolkit_names[@]}"; do
    [[ $name == "$kind"/* ]] || continue
    if [ -e "$dir/${name#*/}" ] || [ -L "$dir/${name#*/}" ]; then
      without_toolkit_names "$dir" "$kind"
      hidden+=("$dir")
      break
    fi
  done
done
echo "ok: covered ${roots[*]:-no toolkit folder}; toolkit names out of ${hidden[*]:-nothing}"

unset CUDA_HOME CUDA_PATH CUDA_ROOT CUDA_TOOLKIT_ROOT CUDA_BIN_PATH CUDAToolkit_ROOT CUDACXX \
  CUDAHOSTCXX
# Drops from the colon-separated list $1 every entry that names CUDA or lies in a toolkit.
without_cuda_entries() {
  local kept=() entry root
  IFS=: read -ra entries <<<"$1"
  for entry in "${entries[@]}"; do
    [[ -n $entry && ${entry,,} != *cuda* ]] || continue
    for root in "${roots[@]}"; do [[ $(realpath -m "$entry") != "$root"* ]] || continue 2; done
    kept+=("$entry")
  done
  (IFS=:; echo "${kept[*]}")
}
PATH=$(without_cuda_entries "$PATH")
for var in LD_LIBRARY_PATH LIBRARY_PATH CPATH C_INCLUDE_PATH CPLUS_INCLUDE_PATH; do
  if [ -n "${!var:-}" ]; then export "$var=$(without_cuda_entries "${!var}")"; fi
done

# The hiding holds: no nvcc, no CUDA header where compilers look, and CMake finds no toolkit.
if command -v nvcc; then echo "FAIL: nvcc is still on PATH"; exit 1; fi
for dir in /usr/local/bin /usr/bin /usr/local/cuda/bin /opt/cuda/bin; do
  if [ -e "$dir/nvcc" ]; then echo "FAIL: $dir/nvcc is still there"; exit 1; fi
done
for dir in /usr/include /usr/local/include /usr/local/cuda/include; do
  if [ -e "$dir/cuda_runtime_api.h" ]; then
    echo "FAIL: $dir/cuda_runtime_api.h is still there"; exit 1
  fi
done
mkdir -p "$work/cmake_finds"
cat >"$work/cmake_finds/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.25)
project(cmake_finds NONE)
find_package(CUDAToolkit QUIET)
include(CheckLanguage)
check_language(CUDA)
if(CUDAToolkit_FOUND OR CMAKE_CUDA_COMPILER)
  message(FATAL_ERROR "CMake finds CUDA: ${CUDAToolkit_NVCC_EXECUTABLE} ${CMAKE_CUDA_COMPILER}")
endif()
CMAKE
cmake -S "$work/cmake_finds" -B "$work/cmake_finds/build" >"$work/cmake_finds.log" 2>&1 ||
  { cat "$work/cmake_finds.log"; exit 1; }
echo "ok: no nvcc on PATH or in the usual folders, no cuda_runtime_api.h; CMake finds no toolkit"

# loom's own configure, from scratch.
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_PYTHON="$python" \
  ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher} >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; exit 1; }
grep -q "CUDA build: OFF" "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
if grep -E -- "-DLOOM_WITH_CUDA|-DUSE_C10D_NCCL|libtorch_cuda|libc10_cuda|/cuda[^/]*/include" \
     "$work/build/build.ninja" >"$work/cuda_lines.txt"; then
  echo "FAIL: the build still names CUDA:"; head -3 "$work/cuda_lines.txt"; exit 1
fi
# torch_cpu's definitions, read from the wheel's export file, reach the compiles.
grep -q -- "-DUSE_DISTRIBUTED" "$work/build/build.ninja" ||
  { echo "FAIL: the compiles lack LibTorch's USE_DISTRIBUTED"; exit 1; }
echo "ok: loom configures without the toolkit: CUDA build OFF, no CUDA flag, header or library"

targets=(loom_build_probe)
if [ "${LOOM_NO_CUDA_FULL:-}" = 1 ]; then targets+=(loom loom_plugin_gpt loom_plugin_preload); fi
cmake --build "$work/build" --target "${targets[@]}" >"$work/build.log" 2>&1 ||
  { tail -40 "$work/build.log"; exit 1; }
probe=$work/build/bin/loom_build_probe
out=$("$probe")
grep -q "device=cpu" <<<"$out" && grep -q "^cuda unavailable" <<<"$out" &&
  grep -q "^ones(2,3).sum() 6" <<<"$out" || { echo "FAIL: the probe says: $out"; exit 1; }
needed=$(readelf -d "$probe" | grep NEEDED)
grep -q "libtorch_cpu.so" <<<"$needed" && grep -q "libc10.so" <<<"$needed" ||
  { echo "FAIL: the probe does not link LibTorch: $needed"; exit 1; }
if grep -E 'libtorch_cuda|libc10_cuda|libtorch\.so|libcudart' <<<"$needed"; then
  echo "FAIL: the probe links CUDA's half of LibTorch"; exit 1
fi
echo "ok: the probe links libtorch_cpu and libc10 only and runs: $(head -1 <<<"$out")"

if [ "${LOOM_NO_CUDA_FULL:-}" = 1 ]; then
  loom=$work/build/bin/loom
  "$loom" --version | grep -q "device=cpu"
  "$loom" check "$src/examples/demo.toml" --set preload.num_workers=1 >/dev/null
  "$loom" run "$src/examples/demo.toml" --set train.max_steps=2 --set preload.num_workers=1 \
    --set "train.output_dir=$work/run" --set train.resume= >"$work/run.log" 2>&1 ||
    { tail -20 "$work/run.log"; exit 1; }
  out=$("$loom" run "$src/examples/demo.toml" --set train.device=cuda \
    --set "train.output_dir=$work/cuda" 2>&1 || true)
  grep -q "built without CUDA" <<<"$out" || { echo "FAIL: device=cuda says: $out"; exit 1; }
  echo "ok: the CLI and plugins built without CUDA check and train a job; cuda is refused: why"
fi

# The installed package on this machine: loomConfig.cmake finds LibTorch without the toolkit.
cmake --install "$build" --prefix "$work/prefix" >/dev/null
LOOM_PYTHON=$python cmake -S "$src/examples/third_party_plugin" -B "$work/plugins" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release \
  ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher} >"$work/plugins.log" 2>&1 ||
  { cat "$work/plugins.log"; exit 1; }
cmake --build "$work/plugins" --target loom_plugin_hello >>"$work/plugins.log" 2>&1 ||
  { tail -40 "$work/plugins.log"; exit 1; }
listing=$(env -u LD_LIBRARY_PATH "$work/prefix/bin/loom" plugins --path "$work/plugins")
grep -q "^hello 1.0.0" <<<"$listing" ||
  { echo "FAIL: the installed loom does not list hello"; exit 1; }
echo "ok: a plugin builds against the installed package without the toolkit; the installed loom"\
  "loads it"
rm -rf "$work"  # kept after a failure, for its logs
echo "passed"
