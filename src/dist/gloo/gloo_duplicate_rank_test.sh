#!/usr/bin/env bash
# The same --rank given twice to one job (ranks started by hand with --rank/--store): the job
# runs, with whichever of the two took the rank's key first; the other fails at once, naming
# the process that holds the rank, and leaves the store as it was (it used to delete the live
# process's key, so the job waited out FUNCOL_TIMEOUT and blamed a rank that had arrived).
# Several rounds, since which duplicate wins is a race. The store is left empty.
#
#   gloo_duplicate_rank_test.sh FUNCOL GRAPH.ir
set -uo pipefail
funcol=$1
graph=$2
work=$(mktemp -d)
trap 'pkill -9 -f -- "--store $work/store" 2>/dev/null; rm -rf "$work"' EXIT
store=$work/store
export FUNCOL_TIMEOUT=20
job() {  # job RANK OUT: one rank of a 2-rank job on $store
  exec "$funcol" run "$graph" --backend gloo --rank "$1" --world-size 2 --store "$store" >"$2" 2>&1
}

# Whether PID runs (a child that exited stays a zombie until waited for).
running() {
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $state != Z* ]]
}

for round in 1 2 3; do
  start=$SECONDS
  job 1 "$work/a" &
  pida=$!
  job 1 "$work/b" &
  pidb=$!
  # Rank 0 comes once a duplicate gave up (at most 10 s): started with them, it could finish
  # the job with the winner before the loser, slow to start on a loaded machine, even looked,
  # and the loser would then rightly wait for a rank 0 that had left.
  for ((i = 0; i < 100; i++)); do
    running "$pida" && running "$pidb" || break
    sleep 0.1
  done
  job 0 "$work/r0" &
  pid0=$!
  wait "$pid0"
  s0=$?
  wait "$pida"
  sa=$?
  wait "$pidb"
  sb=$?
  took=$((SECONDS - start))
  # Exactly one of the two rank-1 processes ran; the other named the one that did.
  if [ "$s0" != 0 ] || [ $((sa == 0)) = $((sb == 0)) ] || [ "$took" -ge 15 ]; then
    echo "gloo_duplicate_rank_test.sh: round $round: exits $s0 (rank 0), $sa and $sb (rank 1)" \
      "after $took s"
    for f in r0 a b; do echo "--- $f"; cat "$work/$f"; done
    exit 1
  fi
  if [ "$sa" = 0 ]; then lost=$work/b; winner=$pida; else lost=$work/a; winner=$pidb; fi
  if ! grep -q "rank 1 is taken by another process that runs (pid $winner on this machine)" \
      "$lost"; then
    echo "gloo_duplicate_rank_test.sh: round $round: the duplicate does not name pid $winner:"
    cat "$lost"
    exit 1
  fi
  if [ -n "$(ls -A "$store")" ]; then
    echo "gloo_duplicate_rank_test.sh: round $round left keys in the store:"
    ls -A "$store"
    exit 1
  fi
done
echo "gloo_duplicate_rank_test.sh: 3 rounds: each job ran, its duplicate rank failed naming the" \
  "other's pid, no keys left"
