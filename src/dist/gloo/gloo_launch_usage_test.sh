#!/usr/bin/env bash
# funcol-gloo-launch's usage: --help and -h print it and exit 0; an unknown option or a missing
# --np or program prints the error, then the usage, and exits 2.
#
#   gloo_launch_usage_test.sh LAUNCH
set -uo pipefail
launch=$1
usage="usage: $(basename "$launch") --np N [--store URL] [--expect-killed R] [--timeout S]"
usage+=" -- program args..."
fail=0
check() {  # check WHAT WANT_STATUS WANT_STDOUT WANT_STDERR -- ARGS...
  local what=$1 want_status=$2 want_out=$3 want_err=$4
  shift 5
  local out err status
  out=$("$launch" "$@" 2>/tmp/gloo_launch_usage.$$)
  status=$?
  err=$(cat /tmp/gloo_launch_usage.$$)
  rm -f /tmp/gloo_launch_usage.$$
  if [ "$status" != "$want_status" ] || [ "$out" != "$want_out" ] ||
     [ "$err" != "$want_err" ]; then
    echo "gloo_launch_usage_test.sh: $what: status $status (want $want_status)"
    echo "  stdout: '$out' (want '$want_out')"
    echo "  stderr: '$err' (want '$want_err')"
    fail=1
  fi
}
me=$(basename "$launch")
check "--help" 0 "$usage" "" -- --help
check "-h" 0 "$usage" "" -- -h
check "unknown option" 2 "" "$me: unknown option '--bogus'"$'\n'"$usage" -- --bogus
check "no program" 2 "" "$usage" -- --np 2
exit $fail
