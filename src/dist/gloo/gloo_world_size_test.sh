#!/usr/bin/env bash
# Two ranks started by hand that disagree on the job on one store: each reads the other's
# arrival and says how, at once (the rank that found it first took its record back at once, and
# the other waited out FUNCOL_TIMEOUT, then named it as not arrived).
# - Different world sizes (2 and 3): Gloo alone reported a garbled address exchange
#   ("sizeof(impl_) == bytes.size()").
# - FUNCOL_DEBUG=detail on one rank only: its signature exchange before each collective met the
#   other rank's data, which that rank took as its result without an error.
#
#   gloo_world_size_test.sh FUNCOL GRAPH.ir
set -uo pipefail
source "$(dirname "$0")/expect_failures.sh"
funcol=$1
graph=$2
work=$(mktemp -d)
trap 'pkill -9 -f -- "--store $work/store" 2>/dev/null; rm -rf "$work"' EXIT
export FUNCOL_TIMEOUT=3
failed=0

# disagree NAME "RANK1 ENV" "RANK1 SIZE" "RANK0 ENV" "RANK0 SIZE" MESSAGE BOTH: the two ranks
# fail within a few seconds, one of them prints MESSAGE and both print BOTH.
disagree() {
  local name=$1 env1=$2 size1=$3 env0=$4 size0=$5 message=$6 both=$7
  rm -rf "$work/store"
  local start
  start=$(date +%s)
  env $env1 "$funcol" run "$graph" --backend gloo --rank 1 --world-size "$size1" \
    --store "$work/store" >"$work/r1" 2>&1 &
  local pid1=$!
  sleep 0.3
  env $env0 "$funcol" run "$graph" --backend gloo --rank 0 --world-size "$size0" \
    --store "$work/store" >"$work/r0" 2>&1 &
  local pid0=$!
  expect_failures "gloo_world_size_test.sh ($name)" "$start" "$work/r0" "$work/r1" -- \
    "$pid0" "$pid1"
  [ "$status" -eq 0 ] || failed=1
  grep -qF "$message" "$work/r0" "$work/r1" ||
    { echo "$name: no rank says: $message"; failed=1; }
  local r
  for r in r0 r1; do
    grep -qF "$both" "$work/$r" || { echo "$name: $r does not say: $both"; cat "$work/$r"; failed=1; }
  done
  [ $(($(date +%s) - start)) -lt "$FUNCOL_TIMEOUT" ] ||
    { echo "$name: the ranks took FUNCOL_TIMEOUT or longer"; failed=1; }
}

disagree "world sizes" "FUNCOL_DEBUG=" 3 "FUNCOL_DEBUG=" 2 \
  "rank 1 was started for 3 ranks, this rank (rank 0) for 2" "was started for"
# Either rank may read the other's arrival first.
disagree "FUNCOL_DEBUG" "FUNCOL_DEBUG=" 2 "FUNCOL_DEBUG=detail" 2 \
  "FUNCOL_DEBUG=DETAIL and this rank (rank " "every rank of a job must set the same FUNCOL_DEBUG"
exit $failed
