# Sourced by the gloo rendezvous tests. expect_failures NAME START OUT... -- PID...: waits for
# every PID, prints the OUT files, and sets `status` to 1 when a process succeeded or when
# they took more than 12 s since START (the tests run with FUNCOL_TIMEOUT=3).
expect_failures() {
  local name=$1 start=$2
  shift 2
  local outs=()
  while [ "$1" != "--" ]; do
    outs+=("$1")
    shift
  done
  shift
  status=0
  local pid
  for pid in "$@"; do
    if wait "$pid"; then
      echo "$name: a rank succeeded"
      status=1
    fi
  done
  local took=$(($(date +%s) - start))
  cat "${outs[@]}"
  if [ "$took" -gt 12 ]; then
    echo "$name: the ranks took $took s to fail (FUNCOL_TIMEOUT=3)"
    status=1
  fi
}
