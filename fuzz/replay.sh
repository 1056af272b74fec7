#!/usr/bin/env bash
# The suite's fuzz check (ctest fuzz.qcow2_replay): fresh qemu-img seeds and
# the recorded reproducers of fixed bugs (fuzz/regressions/) replayed once
# each through the fuzz target, in whichever build runs it (under ASan +
# UBSan in build-asan), each with MUTATIONS deterministic hostile variants. Fuzzing for new inputs is scripts/fuzz.sh.
#   fuzz/replay.sh REPLAY_BINARY
set -euo pipefail
bin=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$(dirname "$0")/make_seeds.sh" "$dir/seeds"
inputs=("$dir/seeds")
[ -d "$(dirname "$0")/regressions" ] && inputs+=("$(dirname "$0")/regressions")
# Seeds also replay with bytes of their metadata overwritten (MUTATIONS
# variants each, default 200): deterministic hostile images.
exec "$bin" --mutations "${MUTATIONS:-200}" "${inputs[@]}"
