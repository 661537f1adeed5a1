#!/usr/bin/env bash
# The documentation against the code, so neither drifts: README.md's commands that finish in
# seconds (the list below: each must be a line of README.md as written) run as written, from a
# scratch folder laid out as the repository's root (build/ and .venv/ linked, examples/
# copied), and prepare_data.py prints what README.md shows under its command; the examples of
# `loom --help` run as written there too; every file that `loom --help`, `loom-launch --help`,
# README.md, docs/architecture.md and examples/README.md name exists.
# usage: docs_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -uo pipefail
# Absolute from here on: the scratch root links build/ and .venv/, and a relative link target
# would be read from inside it (ctest passes them relative, so both forms stay tested).
absolute() { (cd "$(dirname "$1")" && printf '%s/%s' "$(pwd)" "$(basename "$1")"); }
build=$(cd "$1" && pwd) src=$(cd "$2" && pwd) python=$(absolute "$3")
work=$(mktemp -d)
trap cleanup_work EXIT  # testlib.sh
# shellcheck source=../distributed/testlib.sh
source "$src/tests/distributed/testlib.sh"
start=$SECONDS

root=$work/root
mkdir -p "$root"
ln -s "$build" "$root/build"
ln -s "$(cd "$(dirname "$python")/.." && pwd)" "$root/.venv"
cp -r "$src/examples" "$root/examples"

# README.md's quick commands. A line ending in a backslash goes on with the next one.
readarray -t readme_lines <<'EOF'
build/bin/loom estimate --params 1e12 --world-size 1024   # model states alone, as DeepSpeed's estimators
build/bin/loom plugins                                    # every plugin, slot and key, with docs
build/bin/loom env                                        # the CPU, its flags, the kernel level, threads
build/bin/loom --version
.venv/bin/python examples/prepare_data.py --train-bpe 2048 --out data/wisdom.bin --seq-len 128 \
    /usr/share/games/fortunes/wisdom
EOF
command=""
for line in "${readme_lines[@]}"; do
  if ! grep -qxF -- "$line" "$src/README.md"; then
    fail "README.md no longer has the line: $line"
    command=""
    continue
  fi
  if [[ $line == *\\ ]]; then command+="${line%\\} "; continue; fi
  command+=$line
  if out=$(cd "$root" && bash -c "$command" 2>"$work/stderr"); then ok "README: ${command%%  *}"
  else fail "README: $command: $(tail -3 "$work/stderr")"; fi
  [[ $command == *prepare_data.py* ]] && prepared=$out
  command=""
done
# What README.md shows prepare_data.py printing (its '# ' lines after the command): the same
# lines but the blank ones, '...' standing for the token count and /abs/path/ for the folder it
# ran in.
shown=$(sed -n '/^\.venv\/bin\/python examples\/prepare_data.py --train-bpe/,/^```/p' "$src/README.md" |
        sed -n 's/^# //p')
if [ -n "$shown" ] && "$python" - "$shown" "${prepared:-}" "$root/" <<'PY'; then
import re, sys
shown, root = sys.argv[1].splitlines(), sys.argv[3]
printed = [line for line in sys.argv[2].splitlines() if line.strip()]
assert len(shown) == len(printed), (shown, printed)
for want, got in zip(shown, printed):
    pattern = re.escape(want).replace(re.escape("..."), ".+").replace(re.escape("/abs/path/"), re.escape(root))
    assert re.fullmatch(pattern, got), (want, got)
PY
  ok "prepare_data.py prints what README.md shows"
else fail "prepare_data.py's output is not README.md's: '${prepared:-}' vs '$shown'"; fi

# `loom --help`'s examples, in order (a run makes what generate reads); a `loom run` trains 2
# steps (a last --set wins), enough to show the words work.
help=$("$build/bin/loom" --help 2>&1)
examples=$(sed -n '/^examples:$/,/^$/p' <<<"$help" | sed -n 's/^  \(loom .*\)/\1/p')
[ -n "$examples" ] || fail "loom --help shows no examples"
while read -r example; do
  [[ $example == "loom run "* ]] && example+=" --set train.max_steps=2"
  if out=$(cd "$root" && PATH="$root/build/bin:$PATH" bash -c "$example" 2>&1); then ok "loom --help: $example"
  else fail "loom --help: $example: $(tail -3 <<<"$out")"; fi
done <<<"$examples"

# Every file a help text or a page names: a path under one of the tree's folders with a file
# name's extension, from the repository's root (build/bin/ from the build folder) or, in a page,
# from the page's folder (a link).
launch_help=$("$build/bin/loom-launch" --help 2>&1)
for doc in "loom --help" "loom-launch --help" README.md docs/architecture.md examples/README.md; do
  case $doc in
    "loom --help") text=$help folder=$src ;;
    "loom-launch --help") text=$launch_help folder=$src ;;
    *) text=$(cat "$src/$doc") folder=$(dirname "$src/$doc") ;;
  esac
  missing=()
  while read -r path; do
    case $path in
      build/bin/*) [ -e "$build/bin/${path#build/bin/}" ] || missing+=("$path") ;;
      *) [ -e "$src/$path" ] || [ -e "$folder/$path" ] || missing+=("$path") ;;
    esac
  done < <(grep -oP '(?<![A-Za-z0-9_./-])(core|plugins|sharding|offload|launch|examples|tests|docs|scripts|cmake|build/bin)/[A-Za-z0-9_./-]*[A-Za-z0-9_]' <<<"$text" |
           grep -E '^build/bin/|\.(toml|py|md|cpp|h|sh|cmake|in|txt|jsonl|csv)$' | sort -u)
  [ ${#missing[@]} -eq 0 ] && ok "every file $doc names exists" || fail "$doc names missing files: ${missing[*]}"
done

echo "$passed passed, $failed failed in $((SECONDS - start)) s"
[ "$failed" -eq 0 ]
