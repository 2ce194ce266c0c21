#!/usr/bin/env bash
# `funcol run --backend mpi` killed with SIGKILL (it cannot stop mpirun then): its ranks watch
# the launcher and exit, so mpirun ends the job and nothing is left running. The killed
# launcher's temporary directory stays; the next launcher removes it.
#
#   mpi_launcher_kill_test.sh FUNCOL
set -uo pipefail
funcol=$1
work=$(mktemp -d)
graph=$work/forever.ir  # a unique path, to find this job's processes
trap 'pkill -9 -f -- "$graph" 2>/dev/null; rm -rf "$work"' EXIT
cat >"$graph" <<'IR'
graph @forever(%x: f32[1024]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %w = wait_tensor(%ar)
  return %w
}
IR
mkdir "$work/tmp"
TMPDIR=$work/tmp "$funcol" run "$graph" --ranks 2 --backend mpi --iters 1000000000 \
  >"$work/out" 2>&1 &
launcher=$!
# Launcher, mpirun and two ranks.
for _ in $(seq 200); do
  [ "$(pgrep -f -- "$graph" | wc -l)" -ge 4 ] && break
  sleep 0.05
done
running=$(pgrep -f -- "$graph" | wc -l)
if [ "$running" -lt 4 ]; then
  echo "mpi_launcher_kill_test.sh: the job did not start ($running processes)"
  cat "$work/out"
  exit 1
fi
sleep 0.5
kill -9 "$launcher"
wait "$launcher" 2>/dev/null
for _ in $(seq 200); do
  [ "$(pgrep -f -- "$graph" | wc -l)" -eq 0 ] && break
  sleep 0.05
done
left=$(pgrep -af -- "$graph")
cat "$work/out"
if [ -n "$left" ]; then
  echo "mpi_launcher_kill_test.sh: 10 s after the launcher was killed these still run:"
  echo "$left"
  exit 1
fi
grep -q "the launcher of this job (pid [0-9]*) is gone; stopping this rank" "$work/out" ||
  { echo "mpi_launcher_kill_test.sh: no rank said why it stopped"; exit 1; }
ls "$work"/tmp/funcol-run-*/.launcher >/dev/null 2>&1 ||
  { echo "mpi_launcher_kill_test.sh: the killed launcher's directory is not where it was"; exit 1; }
TMPDIR=$work/tmp "$funcol" run "$graph" --ranks 2 --backend mpi --iters 1 >"$work/next" 2>&1 ||
  { echo "mpi_launcher_kill_test.sh: the next job failed:"; cat "$work/next"; exit 1; }
left=$(ls -A "$work/tmp")
if [ -n "$left" ]; then
  echo "mpi_launcher_kill_test.sh: the next launcher left the killed one's directory: $left"
  exit 1
fi
