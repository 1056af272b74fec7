#!/bin/sh
# Fails when a tracked C++ file differs from what clang-format makes of it
# (.clang-format at the top); names the files. Fix with:
#   git ls-files '*.cc' '*.h' | xargs clang-format -i
set -eu
cd "${1:-$(dirname "$0")/../..}"
if ! command -v clang-format >/dev/null; then
  echo "check_format: clang-format is not installed (scripts/deps.sh installs it)" >&2
  exit 1
fi
bad=0
for f in $(git ls-files '*.cc' '*.h'); do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "$f: not formatted (clang-format -i $f)"
    bad=1
  fi
done
[ "$bad" = 0 ] && echo "check_format: every file is formatted"
exit "$bad"
