#!/usr/bin/env bash
# Run the given pytest targets N times, each time in a fresh pytest process (fresh servers, fresh engines), and
# tally the runs that passed. A test that fails some of the time is a failing test: use this before trusting any
# change to the server, threads or timing.
#
#   scripts/repeat-tests.sh 20 tests/test_server.py tests/test_batch.py
set -uo pipefail
runs=$1; shift
passed=0
for i in $(seq 1 "$runs"); do
    if python -m pytest -q -p no:cacheprovider "$@" > "/tmp/repeat-tests.$i.log" 2>&1; then
        passed=$((passed + 1)); echo "run $i: passed ($(tail -1 "/tmp/repeat-tests.$i.log"))"
    else
        echo "run $i: FAILED (log: /tmp/repeat-tests.$i.log)"; grep -E "^(FAILED|ERROR)" "/tmp/repeat-tests.$i.log"
    fi
done
echo "$passed of $runs runs passed"
[ "$passed" -eq "$runs" ]
