#!/usr/bin/env bash
# Starts a private Redis server on a free port, runs two ranks of a gloo program with
# FUNCOL_STORE=redis://127.0.0.1:PORT twice (the second run proves the first removed its
# rendezvous keys), and stops the server.
#
#   gloo_redis_test.sh GLOO_LAUNCH PROGRAM ARGS...     (exit 77: skipped, no redis-server)
set -uo pipefail
launch=$1
shift

source "$(dirname "$0")/redis_server.sh"
start_redis gloo_redis_test.sh

for run in 1 2; do
  echo "gloo_redis_test.sh: run $run with FUNCOL_STORE=redis://127.0.0.1:$port"
  "$launch" --np 2 --timeout 500 --store "redis://127.0.0.1:$port" -- "$@" || exit 1
done
# A key a killed job left where rank 0 arrives: that job fails within FUNCOL_TIMEOUT, saying
# so, and takes the stale key away; the job after it runs.
redis-cli -p "$port" set funcol/world/arrive/0 "2 plain -" >/dev/null
echo "gloo_redis_test.sh: a run on a store with a stale key (expected to fail)"
if FUNCOL_TIMEOUT=3 "$launch" --np 2 --timeout 60 --store "redis://127.0.0.1:$port" -- "$@" \
    >"$work/stale.log" 2>&1; then
  echo "gloo_redis_test.sh: a run on a store with a stale key succeeded"
  exit 1
fi
if ! grep -q "a previous job left its keys" "$work/stale.log"; then
  echo "gloo_redis_test.sh: the run on a stale store does not say so:"
  cat "$work/stale.log"
  exit 1
fi
echo "gloo_redis_test.sh: run 3, after the failed one"
"$launch" --np 2 --timeout 500 --store "redis://127.0.0.1:$port" -- "$@" || exit 1
# The address Gloo writes under rank 1's index, left by a job killed during the address
# exchange: the job that finds it fails, and rank 1 takes it away with its other keys (it
# stayed there for good, failing every later job, while only funcol's own keys were removed).
redis-cli -p "$port" set funcol/world/1 "stale" >/dev/null
echo "gloo_redis_test.sh: a run on a store with a stale address key (expected to fail)"
if FUNCOL_TIMEOUT=3 "$launch" --np 2 --timeout 60 --store "redis://127.0.0.1:$port" -- "$@" \
    >"$work/stale_address.log" 2>&1; then
  echo "gloo_redis_test.sh: a run on a store with a stale address key succeeded"
  exit 1
fi
echo "gloo_redis_test.sh: run 4, after the failed one"
"$launch" --np 2 --timeout 500 --store "redis://127.0.0.1:$port" -- "$@" || {
  echo "gloo_redis_test.sh: the run after the stale address key failed too:"
  cat "$work/stale_address.log"
  exit 1
}
left=$(redis-cli -p "$port" dbsize)
if [ "$left" != "0" ]; then
  echo "gloo_redis_test.sh: $left rendezvous keys were left in Redis:"
  redis-cli -p "$port" keys '*'
  exit 1
fi
# A server that accepts connections but never answers (stopped here; an overloaded one, or a
# proxy in front of a dead one): the ranks fail after FUNCOL_TIMEOUT, saying so, instead of
# blocking in read() for as long as it stays silent.
kill -STOP "$redis_pid"
echo "gloo_redis_test.sh: a run on a server that stopped answering (expected to fail)"
start=$SECONDS
FUNCOL_TIMEOUT=2 "$launch" --np 2 --timeout 60 --store "redis://127.0.0.1:$port" -- "$@" \
  >"$work/silent.log" 2>&1
status=$?
took=$((SECONDS - start))
kill -CONT "$redis_pid"
if [ "$status" = 0 ] || [ "$took" -gt 20 ] || \
    ! grep -q "did not answer within 2000 ms" "$work/silent.log"; then
  echo "gloo_redis_test.sh: the run on a silent server exited $status after $took s:"
  cat "$work/silent.log"
  exit 1
fi
# Commands the silent server had queued run once it wakes, after their clients gave up.
sleep 0.5
redis-cli -p "$port" flushall >/dev/null
# A server silent for longer than FUNCOL_TIMEOUT while rank 0 waits for rank 1: rank 0 fails,
# and still takes its arrival key away once the server answers again (its connection is in
# error after the timeout; the cleanup connects again), so the next job runs. Silent for 8 s,
# past the cleanup's own 2 s look too, rank 0 exits first: its deletions, sent on a new
# connection without waiting for replies, run once the server wakes (they were never sent).
echo "gloo_redis_test.sh: rank 0 alone, the server silent for 8 s (expected to fail)"
RANK=0 WORLD_SIZE=2 FUNCOL_STORE="redis://127.0.0.1:$port" FUNCOL_TIMEOUT=3 "$@" \
  >"$work/stall.log" 2>&1 &
rank0=$!
for _ in $(seq 100); do
  [ "$(redis-cli -p "$port" dbsize)" != 0 ] && break
  sleep 0.05
done
kill -STOP "$redis_pid"
sleep 8
kill -CONT "$redis_pid"
wait "$rank0"
status=$?
sleep 0.5
left=$(redis-cli -p "$port" dbsize)
if [ "$status" = 0 ] || [ "$left" != 0 ] || ! grep -q "did not answer within 3000 ms" "$work/stall.log"; then
  echo "gloo_redis_test.sh: rank 0 exited $status and left $left keys after the stall:"
  cat "$work/stall.log"
  exit 1
fi
"$launch" --np 2 --timeout 500 --store "redis://127.0.0.1:$port" -- "$@" || exit 1
echo "gloo_redis_test.sh: runs 1-4 passed, each stale key failed one run only; no keys left;" \
  "a silent server failed the run in $took s; one that woke took no key with it"
