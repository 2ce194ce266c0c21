#!/usr/bin/env bash
# A store directory that a killed job left dirty: the next job's ranks, started by hand with
# --rank/--store, must each fail with a CommError within FUNCOL_TIMEOUT (not Gloo's fixed 30 s
# wait, and never hang), the rank whose key is taken saying the store is dirty; the job after
# them runs.
#
#   gloo_stale_store_test.sh FUNCOL GRAPH.ir
set -uo pipefail
source "$(dirname "$0")/expect_failures.sh"
funcol=$1
graph=$2
work=$(mktemp -d)
trap 'pkill -9 -f -- "--store $work/store" 2>/dev/null; rm -rf "$work"' EXIT
store=$work/store
job() {  # job RANK OUT: one rank of a 2-rank job on $store
  exec "$funcol" run "$graph" --backend gloo --rank "$1" --world-size 2 --store "$store" >"$2" 2>&1
}

# Rank 0 alone, killed while it waits for rank 1: its arrival key stays.
job 0 /dev/null &
for _ in $(seq 100); do
  [ -n "$(ls -A "$store" 2>/dev/null)" ] && break
  sleep 0.05
done
sleep 0.2
kill -9 $! 2>/dev/null
wait 2>/dev/null
if [ -z "$(ls -A "$store" 2>/dev/null)" ]; then
  echo "gloo_stale_store_test.sh: the killed rank left no key in $store"
  exit 1
fi

# Rank 1 first: it takes the stale key for rank 0's arrival and waits for rank 0's address in
# Gloo's connectFullMesh; then rank 0 finds its key taken.
export FUNCOL_TIMEOUT=3
start=$(date +%s)
job 1 "$work/r1" &
pid1=$!
sleep 0.5
job 0 "$work/r0" &
pid0=$!
expect_failures gloo_stale_store_test.sh "$start" "$work/r0" "$work/r1" -- "$pid0" "$pid1"
grep -q "a previous job left its keys" "$work/r0" ||
  { echo "rank 0 does not name the dirty store"; status=1; }
grep -q "never connected.*previous job left their keys" "$work/r1" ||
  { echo "rank 1 does not say that rank 0 never connected"; status=1; }

# Only that job fails: rank 0 took the stale key away, so the next job on the store runs.
job 0 "$work/n0" &
next0=$!
job 1 "$work/n1" &
next1=$!
for pid in $next0 $next1; do
  if ! wait "$pid"; then
    echo "gloo_stale_store_test.sh: the job after the failed one failed too:"
    cat "$work/n0" "$work/n1"
    status=1
  fi
done
exit $status
