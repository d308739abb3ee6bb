#!/usr/bin/env bash
# Run CI as a stranger would: clone this repository's HEAD into a new directory, make a fresh virtual environment
# there, and run .ci/run (the README's test command, then scripts/lint). Prints the outcome and the time taken;
# the log stays in the clone's directory.
#
#   scripts/ci-fresh.sh [DIR]        # default DIR: a new directory under /tmp
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$(mktemp -d /tmp/tinyloop-ci.XXXXXX)}
git clone -q "$src" "$dir/repo" || exit 1
cd "$dir/repo" || exit 1
python3 -m venv "$dir/venv" && . "$dir/venv/bin/activate" || exit 1
start=$(date +%s)
.ci/run > "$dir/ci.log" 2>&1
rc=$?
echo "fresh clone of $(git rev-parse --short HEAD): .ci/run exit $rc in $(( $(date +%s) - start )) s (log: $dir/ci.log)"
exit $rc
