#!/usr/bin/env bash
# Starts N ranks of a gloo program on this host (RANK, WORLD_SIZE, FUNCOL_STORE), waits for
# them, kills any left after --timeout seconds (default: no limit), and fails when a rank fails.
# Installed as bin/funcol-gloo-launch.
#
#   funcol-gloo-launch --np N [--store URL] [--expect-killed R] [--timeout S] -- program args...
#
# Without --store, a fresh temporary directory is the file store (removed at the end). Each
# rank's output is printed, prefixed "[rank R]", once all ranks are done (a job that hangs
# prints nothing until --timeout kills it, or SIGINT or SIGTERM stops the launcher, which kills
# the ranks and exits 130 or 143). --expect-killed R
# accepts rank R dying of SIGKILL (the failure tests); any other non-zero exit fails the run.
# A rank that stopped itself (SIGSTOP) is killed (SIGKILL) once every other rank has exited,
# not before: the others may still be asking it for its progress.
set -uo pipefail

me=$(basename "$0")
usage() {
  echo "usage: $me --np N [--store URL] [--expect-killed R] [--timeout S] --" \
       "program args..."
}
np=""
store=""
expect_killed=-1
timeout=0
while [ $# -gt 0 ]; do
  case "$1" in
    --np|--store|--expect-killed|--timeout)
      if [ $# -lt 2 ]; then echo "$me: $1 needs a value" >&2; exit 2; fi ;;
  esac
  case "$1" in
    --np) np=$2; shift 2 ;;
    --store) store=$2; shift 2 ;;
    --expect-killed) expect_killed=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "$me: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if [ -z "$np" ] || [ $# -eq 0 ]; then
  usage >&2
  exit 2
fi
if ! [[ $np =~ ^[1-9][0-9]*$ ]]; then
  echo "$me: --np must be a positive integer, got '$np'" >&2
  exit 2
fi
# Decimal, without leading zeros: bash reads 010 as octal.
if ! [[ $timeout =~ ^(0|[1-9][0-9]*)$ ]]; then
  echo "$me: --timeout must be a whole number of seconds (0: no limit), got '$timeout'" >&2
  exit 2
fi
if ! [[ $expect_killed =~ ^(-1|0|[1-9][0-9]*)$ ]]; then
  echo "$me: --expect-killed must be a rank, got '$expect_killed'" >&2
  exit 2
fi

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
# Interrupted (Ctrl-C, a job scheduler's SIGTERM): the ranks go, and what they printed until then
# is shown, as after --timeout (often what the user stopped a hung job to read).
print_logs() {
  local r
  for ((r = 0; r < ${#pids[@]}; r++)); do
    sed "s/^/[rank $r] /" "$work/rank$r.log" 2>/dev/null
  done
}
interrupted() {
  echo "$me: $1; killing every rank" >&2
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done  # (without bash's "Killed" notices)
  print_logs
  exit "$2"
}
trap 'interrupted "interrupted (SIGINT)" 130' INT
trap 'interrupted "terminated (SIGTERM)" 143' TERM
if [ -z "$store" ]; then
  mkdir "$work/store"
  store="file://$work/store"
fi

# The ranks end with this launcher, even one killed with SIGKILL, which cannot stop them
# (funcol's process backends follow FUNCOL_LAUNCHER_PID: process_env.h, follow_launcher).
export FUNCOL_LAUNCHER_PID=$$
FUNCOL_LAUNCHER_PIDNS=$(readlink /proc/$$/ns/pid 2>/dev/null)
export FUNCOL_LAUNCHER_PIDNS
for ((r = 0; r < np; r++)); do
  RANK=$r WORLD_SIZE=$np FUNCOL_STORE=$store "$@" >"$work/rank$r.log" 2>&1 &
  pids+=($!)
done

# Rank $1's process is stopped and every other rank's has exited.
only_stopped_left() {
  grep -q '^State:[[:space:]]*T' "/proc/${pids[$1]}/status" 2>/dev/null || return 1
  local o
  for ((o = 0; o < np; o++)); do
    [ "$o" -eq "$1" ] || ! kill -0 "${pids[$o]}" 2>/dev/null || return 1
  done
}

# A hang is a failure, not a stuck CI: past the deadline every rank left is killed.
if [ "$timeout" -gt 0 ]; then deadline=$((SECONDS + timeout)); else deadline=-1; fi
before_deadline() { [ "$deadline" -lt 0 ] || [ $SECONDS -lt "$deadline" ]; }
status=0
for ((r = 0; r < np; r++)); do
  pid=${pids[$r]}
  while kill -0 "$pid" 2>/dev/null && before_deadline; do
    only_stopped_left "$r" && kill -9 "$pid" 2>/dev/null
    # Poll: bash cannot wait for one child with a timeout.
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "$me: rank $r still running after ${timeout} s; killing every rank" >&2
    status=1
    break
  fi
  # (stderr: bash's own "Killed" notice for the expected SIGKILL)
  wait "$pid" 2>/dev/null
  rc=$?
  if [ $rc -eq 137 ] && [ "$r" -eq "$expect_killed" ]; then
    echo "$me: rank $r was killed (SIGKILL), as expected"
  elif [ $rc -ne 0 ]; then
    echo "$me: rank $r exited with status $rc" >&2
    status=1
  fi
done
for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
print_logs
exit $status
