#!/usr/bin/env bash
# Two ranks started by hand with different world sizes (2 and 3) on one store: the rank that
# reads the other's arrival says the world sizes differ (Gloo alone reported a garbled address
# exchange, "sizeof(impl_) == bytes.size()"), and both fail within FUNCOL_TIMEOUT.
#
#   gloo_world_size_test.sh FUNCOL GRAPH.ir
set -uo pipefail
source "$(dirname "$0")/expect_failures.sh"
funcol=$1
graph=$2
work=$(mktemp -d)
trap 'pkill -9 -f -- "--store $work/store" 2>/dev/null; rm -rf "$work"' EXIT
export FUNCOL_TIMEOUT=3
start=$(date +%s)
"$funcol" run "$graph" --backend gloo --rank 1 --world-size 3 --store "$work/store" \
  >"$work/r1" 2>&1 &
pid1=$!
sleep 0.3
"$funcol" run "$graph" --backend gloo --rank 0 --world-size 2 --store "$work/store" \
  >"$work/r0" 2>&1 &
pid0=$!
expect_failures gloo_world_size_test.sh "$start" "$work/r0" "$work/r1" -- "$pid0" "$pid1"
grep -q "rank 1 was started for 3 ranks, this rank (rank 0) for 2" "$work/r0" ||
  { echo "rank 0 does not say that the world sizes differ"; status=1; }
exit $status
