#!/usr/bin/env bash
# funcol-gloo-launch stopped by SIGINT (Ctrl-C) or SIGTERM while its ranks run: it kills them,
# prints what they wrote until then (it used to delete their logs unread) and exits 130 or 143.
#
#   gloo_launch_interrupt_test.sh LAUNCH
set -uo pipefail
launch=$1
work=$(mktemp -d)
marker=$work/marker  # a unique argument, to find this test's ranks
trap 'pkill -9 -f -- "$marker" 2>/dev/null; rm -rf "$work"' EXIT
# Job control: a background job then keeps SIGINT (a script's background commands ignore it).
set -m
for sig in INT TERM; do
  want=$([ $sig = INT ] && echo 130 || echo 143)
  "$launch" --np 2 -- sh -c 'echo "rank $RANK started"; while :; do sleep 0.1; done' "$marker" \
    >"$work/out" 2>&1 &
  launcher=$!
  for _ in $(seq 200); do
    [ "$(pgrep -f -- "$marker" | grep -vc "^$launcher$")" -ge 2 ] && break
    sleep 0.05
  done
  sleep 0.3  # the ranks' first line written
  kill -$sig "$launcher"
  wait "$launcher"
  status=$?
  sleep 0.2
  left=$(pgrep -af -- "$marker" | grep -v "^$launcher ")
  cat "$work/out"
  if [ $status -ne "$want" ]; then
    echo "gloo_launch_interrupt_test.sh: SIG$sig: exit status $status, expected $want"
    exit 1
  fi
  if [ -n "$left" ]; then
    echo "gloo_launch_interrupt_test.sh: SIG$sig: ranks left running:"
    echo "$left"
    exit 1
  fi
  for r in 0 1; do
    grep -q "^\[rank $r\] rank $r started" "$work/out" ||
      { echo "gloo_launch_interrupt_test.sh: SIG$sig: rank $r's output was not printed"; exit 1; }
  done
done
echo "gloo_launch_interrupt_test.sh: passed"
