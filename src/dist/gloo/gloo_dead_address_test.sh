#!/usr/bin/env bash
# A rank that finds a dead rank's address in the store (the rank died during Gloo's address
# exchange, or a killed job left it there) fails within FUNCOL_TIMEOUT, saying that the address
# did not answer. Gloo waits five times a pair's timeout for its first connection; it waited
# 5 x FUNCOL_TIMEOUT when this rank's side of the pair was the one that listens.
#
# Rank 1 runs with rank 0's keys as a rank 0 that reached the address exchange would leave
# them (its arrival and host name): it writes its address and waits for rank 0's, and is
# killed there (its arrival record then rewritten to name another machine's process). With
# those planted keys deleted, rank 0 then runs against the dead address.
# Which side of a pair listens depends on the two (random) ports, so this is done 6 times.
#
#   gloo_dead_address_test.sh FUNCOL GRAPH.ir     (exit 77: skipped, no redis-server)
set -uo pipefail
funcol=$1
graph=$2
source "$(dirname "$0")/redis_server.sh"
start_redis gloo_dead_address_test.sh
store=redis://127.0.0.1:$port
kv() { redis-cli -p "$port" "$@"; }
rank() {  # rank R TIMEOUT OUT: one rank of a 2-rank job on the store
  FUNCOL_TIMEOUT=$2 exec "$funcol" run "$graph" --backend gloo --rank "$1" --world-size 2 \
    --store "$store" >"$3" 2>&1
}

timeout_s=2
for attempt in 1 2 3 4 5 6; do
  kv set funcol/world/arrive/0 "2 plain -" >/dev/null
  kv set funcol/world/rank_0 "$(hostname)" >/dev/null
  rank 1 60 "$work/r1" &
  pid1=$!
  for _ in $(seq 300); do
    [ "$(kv exists funcol/world/1)" = 1 ] && break
    sleep 0.05
  done
  if [ "$(kv exists funcol/world/1)" != 1 ]; then
    echo "gloo_dead_address_test.sh: rank 1 never wrote its address:"
    cat "$work/r1"
    exit 1
  fi
  kill -9 "$pid1"
  wait "$pid1" 2>/dev/null
  kv del funcol/world/arrive/0 funcol/world/rank_0 >/dev/null
  # Its arrival record as another machine's rank would have written it: one of this machine
  # whose process ended is stale, and rank 0 would wait for rank 1 to replace it instead.
  record=$(kv get funcol/world/arrive/1)
  kv set funcol/world/arrive/1 "${record% *} elsewhere/0/1/2/3/4" >/dev/null

  start=$(date +%s.%N)
  if (rank 0 "$timeout_s" "$work/r0"); then
    echo "gloo_dead_address_test.sh: rank 0 connected to a dead rank"
    exit 1
  fi
  took=$(python3 -c "import sys; print(round($(date +%s.%N) - $start, 2))")
  echo "attempt $attempt: rank 0 failed after $took s (FUNCOL_TIMEOUT=$timeout_s):"
  cat "$work/r0"
  # The timeout, plus a second for starting the process and the rendezvous before Gloo's.
  if python3 -c "import sys; sys.exit(0 if $took <= $timeout_s + 1.5 else 1)"; then :; else
    echo "gloo_dead_address_test.sh: rank 0 took $took s, more than FUNCOL_TIMEOUT=$timeout_s"
    exit 1
  fi
  if ! grep -q "address in '$store' did not answer, waited for up to 2000 ms" "$work/r0"; then
    echo "gloo_dead_address_test.sh: rank 0 does not say that the address did not answer"
    exit 1
  fi
  # Rank 0 removed its own keys; the dead rank's are left (the next job's rank 1 would remove
  # them). Clear them for the next attempt.
  kv del funcol/world/arrive/1 funcol/world/rank_1 funcol/world/1 >/dev/null
  left=$(kv dbsize)
  if [ "$left" != 0 ]; then
    echo "gloo_dead_address_test.sh: $left keys left besides the dead rank's:"
    kv keys '*'
    exit 1
  fi
done
echo "gloo_dead_address_test.sh: every attempt failed within FUNCOL_TIMEOUT, naming the cause"
