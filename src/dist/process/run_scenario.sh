#!/usr/bin/env bash
# Runs a failure scenario's launcher command and checks its report: at least --ok lines
# "SCENARIO OK", no "SCENARIO FAILED", the exit status (--exit zero|nonzero|any), a run time
# under --within seconds, and optional --grep patterns in the output.
# A rank that stops itself prints "SCENARIO STOPPED pid P"; where that line comes while the
# command runs (mpirun; gloo_launch.sh prints at the end and kills such a rank itself), P is
# killed (SIGKILL) once --ok ranks reported SCENARIO OK or one reported SCENARIO FAILED, so that
# no survivor sees the stopped rank die while it still expects silence from it.
#
#   run_scenario.sh --ok N [--exit zero|nonzero|any] [--within S] [--grep PATTERN]... -- cmd...
set -uo pipefail

want_ok=0
want_exit=zero
within=600
patterns=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ok) want_ok=$2; shift 2 ;;
    --exit) want_exit=$2; shift 2 ;;
    --within) within=$2; shift 2 ;;
    --grep) patterns+=("$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "run_scenario.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done

out=$(mktemp)
trap 'rm -f "$out"' EXIT
start=$SECONDS
# Its own process group, so that a launcher left hanging is killed with everything it started.
setsid "$@" >"$out" 2>&1 &
pid=$!
hung=0
stopped_killed=0
kill_stopped() {
  [ $stopped_killed -eq 0 ] || return 0
  local n
  n=$(grep -c "SCENARIO OK" "$out")
  if [ "$n" -ge "$want_ok" ] || grep -q "SCENARIO FAILED" "$out"; then
    stopped_killed=1
    for p in $(sed -n 's/.*SCENARIO STOPPED pid \([0-9]*\).*/\1/p' "$out"); do
      kill -9 "$p" 2>/dev/null
    done
  fi
}
while kill -0 "$pid" 2>/dev/null; do
  grep -q "SCENARIO STOPPED" "$out" && kill_stopped
  if [ $((SECONDS - start)) -gt $((within + 10)) ]; then
    hung=1
    kill -9 -- "-$pid" 2>/dev/null
    break
  fi
  sleep 0.2
done
wait "$pid" 2>/dev/null
rc=$?
took=$((SECONDS - start))
cat "$out"

fail() { echo "run_scenario.sh: $*" >&2; exit 1; }
oks=$(grep -c "SCENARIO OK" "$out")
grep -q "SCENARIO FAILED" "$out" && fail "a rank reported SCENARIO FAILED"
[ "$oks" -ge "$want_ok" ] || fail "$oks ranks reported SCENARIO OK, expected $want_ok"
case "$want_exit" in
  zero) [ $rc -eq 0 ] || fail "exit status $rc, expected 0" ;;
  nonzero) [ $rc -ne 0 ] || fail "exit status 0, expected a failure" ;;
esac
if [ $hung -eq 1 ]; then
  # Every rank reported, but the launcher did not exit: Open MPI 4.1.4's mpirun can deadlock
  # in PMIx_server_finalize when one rank finalised and another exited with an error.
  [ "$want_exit" = any ] || fail "the command was still running after $took s; killed it"
  echo "run_scenario.sh: note: the launcher hung after every rank reported; killed it"
else
  [ $took -le "$within" ] || fail "took $took s, limit $within s"
fi
for p in "${patterns[@]}"; do
  grep -q -- "$p" "$out" || fail "no '$p' in the output"
done
echo "run_scenario.sh: passed ($oks ranks OK, exit status $rc, $took s)"
