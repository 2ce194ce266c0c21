#!/usr/bin/env bash
# funcol-gloo-launch killed with SIGKILL, which it cannot trap: its ranks end with it. A rank it
# started itself dies with it; one started through a wrapper (`sh -c`, whose child the rank
# is) sees it gone and says so. Both used to run on, orphaned, holding their ports and memory.
# A rank in its own PID namespace, which cannot see the launcher, runs on unharmed.
#
#   gloo_launch_killed_test.sh LAUNCH PROCESS_SCENARIO
set -uo pipefail
launch=$1
scenario=$2
work=$(mktemp -d)
marker=$work/marker  # a unique argument, to find this test's processes
trap 'pkill -9 -f -- "$marker" 2>/dev/null; rm -rf "$work"' EXIT
# Waits for both ranks of the current case to have joined (their files in $ready).
wait_joined() {
  for _ in $(seq 300); do
    [ -e "$ready/rank0" ] && [ -e "$ready/rank1" ] && return
    sleep 0.05
  done
  fail "the ranks did not join within 15 s"
}
fail() {
  echo "gloo_launch_killed_test.sh: $how: $1"
  cat "$work"/tmp.*/rank*.log 2>/dev/null
  exit 1
}
for how in direct wrapped; do
  ready=$work/ready-$how
  mkdir "$ready"
  rm -rf "$work"/tmp.*
  args=(--backend=gloo --scenario=linger "--ready=$ready" "$marker")
  # The launcher's own directory (its ranks' logs) in $work: a killed launcher leaves it.
  if [ $how = direct ]; then
    TMPDIR=$work "$launch" --np 2 -- "$scenario" "${args[@]}" >/dev/null 2>&1 &
  else
    TMPDIR=$work "$launch" --np 2 -- sh -c '"$0" "$@"; echo "exit status $?"' "$scenario" \
      "${args[@]}" >/dev/null 2>&1 &
  fi
  launcher=$!
  wait_joined
  kill -9 "$launcher"
  wait "$launcher" 2>/dev/null
  for _ in $(seq 100); do
    pgrep -f -- "$marker" >/dev/null || break
    sleep 0.05
  done
  left=$(pgrep -af -- "$marker")
  [ -z "$left" ] || fail "processes still running 5 s after their launcher was killed:
$left"
  if [ $how = wrapped ]; then
    for r in 0 1; do
      grep -q "the launcher of this job (pid $launcher) is gone; stopping this rank" \
        "$work"/tmp.*/rank$r.log || fail "rank $r did not say why it stopped"
      grep -q "^exit status 1$" "$work"/tmp.*/rank$r.log || fail "rank $r did not exit with 1"
    done
  fi
done
# A rank in its own PID namespace (unshare --pid, a container) cannot see its launcher's pid: it
# must not take the launcher for gone (both ranks stopped at once, a healthy job failed).
how=namespaced
if unshare --pid --fork true 2>/dev/null; then
  ready=$work/ready-$how
  mkdir "$ready"
  TMPDIR=$work "$launch" --np 2 -- unshare --pid --fork "$scenario" --backend=gloo \
    --scenario=linger "--ready=$ready" "$marker" >/dev/null 2>&1 &
  launcher=$!
  wait_joined
  kill -9 "$launcher"
  wait "$launcher" 2>/dev/null
  pkill -9 -f -- "$marker"
else
  echo "gloo_launch_killed_test.sh: no unshare --pid here: the namespaced case is not run"
fi
echo "gloo_launch_killed_test.sh: passed"
