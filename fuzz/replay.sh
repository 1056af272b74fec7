#!/usr/bin/env bash
# The suite's fuzz checks (ctest fuzz.<target>_replay): a target's seeds and
# the recorded reproducers of fixed bugs (fuzz/regressions/<target>/)
# replayed once each through its entry point, in whichever build runs it
# (under ASan + UBSan in build-asan), each with MUTATIONS deterministic
# hostile variants. Seeds are fresh qemu-img images for qcow2
# (fuzz/make_seeds.sh) and the checked-in fuzz/seeds/<target>/ for the
# others. Fuzzing for new inputs is scripts/fuzz.sh.
#   fuzz/replay.sh TARGET REPLAY_BINARY
set -euo pipefail
target=$1
bin=$2
here=$(dirname "$0")
inputs=()
if [ "$target" = qcow2 ]; then
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
  "$here/make_seeds.sh" "$dir/seeds"
  inputs+=("$dir/seeds")
  # Seeds also replay with bytes of their metadata overwritten (MUTATIONS
  # variants each, default 200): deterministic hostile images.
  mutations=${MUTATIONS:-200}
else
  inputs+=("$here/seeds/$target")
  # The protocol and parser targets are cheaper per input but their seeds
  # are many: fewer variants each.
  mutations=${MUTATIONS:-20}
fi
[ -d "$here/regressions/$target" ] && inputs+=("$here/regressions/$target")
exec "$bin" --mutations "$mutations" "${inputs[@]}"
