#!/usr/bin/env bash
# Note [SDK digest] (loom/plugin.h): the SDK headers' digest must be the one recorded for
# LOOM_PLUGIN_API_VERSION in core/sdk_digests.txt, so a change to what plugins compile against
# cannot land without a new API version. Also checks that the check can fail: a copy of the
# headers with one member added is refused, and one with only a comment reworded passes.
#   tests/core/sdk_digest.sh SOURCE_DIR
set -euo pipefail
src=${1:?usage: sdk_digest.sh SOURCE_DIR}

# check INCLUDE_DIR RECORD_FILE: exit 0 when the digest is the one recorded for the version.
check() {
  local dir=$1 record=$2 version digest recorded
  version=$(sed -n 's/^#define LOOM_PLUGIN_API_VERSION \([0-9]*\)u.*/\1/p' "$dir/plugin.h")
  [ -n "$version" ] || { echo "no LOOM_PLUGIN_API_VERSION in $dir/plugin.h"; return 1; }
  digest=$("$src/scripts/sdk-digest" "$dir")
  recorded=$(awk -v v="$version" '$1 == v { print $2 }' "$record")
  if [ -z "$recorded" ]; then
    echo "API version $version has no digest in $record: add the line '$version $digest'"
    return 1
  fi
  if [ "$recorded" != "$digest" ]; then
    echo "the SDK headers ($dir) changed since API version $version was recorded (digest" \
      "$digest, recorded $recorded): bump LOOM_PLUGIN_API_VERSION in loom/plugin.h to" \
      "$((version + 1)) and add the line '$((version + 1)) $digest' to $record"
    return 1
  fi
  # One digest per version: two versions with one digest mean a bump without a change.
  local twice
  twice=$(awk '!/^#/ && NF { print $2 }' "$record" | sort | uniq -d)
  [ -z "$twice" ] || { echo "digest $twice is recorded for two API versions in $record"; return 1; }
  echo "API version $version: SDK digest $digest as recorded"
}

check "$src/core/include/loom" "$src/core/sdk_digests.txt"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$src"/core/include/loom/*.h "$tmp/"
sed -i 's|^  virtual std::string description() const = 0;|&\n  virtual int added_member() const { return 0; }|' "$tmp/plugin.h"
grep -q added_member "$tmp/plugin.h" || { echo "FAIL: the mutation did not apply"; exit 1; }
if out=$(check "$tmp" "$src/core/sdk_digests.txt"); then
  echo "FAIL: a header with an added member passed the check"; exit 1
fi
case "$out" in *"bump LOOM_PLUGIN_API_VERSION"*) echo "refused as it must be: $out" ;;
  *) echo "FAIL: unexpected message: $out"; exit 1 ;; esac

cp "$src"/core/include/loom/*.h "$tmp/"
sed -i 's|^// loom/plugin.h — the plugin contract|// loom/plugin.h — the plugin contract, reworded|' "$tmp/plugin.h"
grep -q reworded "$tmp/plugin.h" || { echo "FAIL: the comment edit did not apply"; exit 1; }
check "$tmp" "$src/core/sdk_digests.txt" >/dev/null || {
  echo "FAIL: a reworded comment changed the digest"; exit 1; }
echo "sdk digest: ok"
