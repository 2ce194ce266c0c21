#!/usr/bin/env bash
# Runs the issue-2 benchmarks (collectives on the threads backend) and prints the RESULTS.md rows.
#
# Usage: bench/run_issue2.sh            (after `make build`; run on a quiet machine)
#   FUNCOL=path/to/funcol   the command (default build/bin/funcol)
#   REPEATS=N               runs per figure; the median is reported (default 3)
#
# Each figure comes from its own `funcol bench` run, which measures its own two-thread memcpy
# and cache-line handoff references first, so every ratio is measured side by side with its
# figure: busbw / memcpy GB/s for bandwidths, time / handoff round trip for latencies. Every
# run checks its results (-c 1); a wrong value stops the script.
set -euo pipefail

FUNCOL=${FUNCOL:-build/bin/funcol}
REPEATS=${REPEATS:-3}
if [[ ! -x $FUNCOL ]]; then
  echo "run_issue2.sh: $FUNCOL not found; run 'make build' first or set FUNCOL" >&2
  exit 1
fi

median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

# row LABEL METRIC GOAL ARGS...: METRIC is busbw (GB/s, higher is better) or time (us, lower).
row() {
  local label=$1 metric=$2 goal=$3
  shift 3
  local values=() pairs=()
  for ((i = 0; i < REPEATS; i++)); do
    local out
    if ! out=$("$FUNCOL" bench "$@"); then
      echo "run_issue2.sh: '$FUNCOL bench $*' failed:" >&2
      echo "$out" >&2
      exit 1
    fi
    # The single data row: size count type redop root time algbw busbw #wrong ratio.
    local data memcpy handoff
    data=$(echo "$out" | awk '!/^#/ && NF >= 10 {print; exit}')
    memcpy=$(echo "$out" | sed -n 's/^# memcpy reference: .*, \([0-9.]*\) GB\/s per thread.*/\1/p')
    handoff=$(echo "$out" | sed -n 's/^# handoff reference: .* round trip \([0-9.]*\) ns.*/\1/p')
    local time busbw ratio
    time=$(echo "$data" | awk '{print $6}')
    busbw=$(echo "$data" | awk '{print $8}')
    ratio=$(echo "$data" | awk '{print $10}')
    local v=$busbw
    if [[ $metric == time ]]; then
      v=$time
      ratio=n/a  # a funcol built before the handoff reference prints none
      [[ -n $handoff ]] && ratio=$(awk -v t="$time" -v h="$handoff" 'BEGIN {printf "%.1f", t * 1000 / h}')
    fi
    [[ -n $handoff ]] || handoff=n/a
    values+=("$v")
    pairs+=("$v $ratio $memcpy $handoff")
  done
  local med
  med=$(printf '%s\n' "${values[@]}" | median)
  # The ratio and reference figures of the run that gave the median.
  local ratio memcpy handoff
  read -r _ ratio memcpy handoff < <(printf '%s\n' "${pairs[@]}" | awk -v m="$med" '$1 == m {print; exit}')
  local unit="GB/s" met
  if [[ $metric == time ]]; then
    unit="us"
    met=$(awk -v v="$med" -v g="$goal" 'BEGIN {print (v <= g) ? "yes" : "no"}')
    goal="<= $goal"
  else
    met=$(awk -v v="$med" -v g="$goal" 'BEGIN {print (v >= g) ? "yes" : "no"}')
    goal=">= $goal"
  fi
  printf '| %s | %s %s | %s | %s | %s | %s | %s %s | %s | `funcol bench %s` |\n' \
    "$label" "$med" "$unit" "$(printf '%s ' "${values[@]}" | sed 's/ $//')" "$memcpy" "$handoff" \
    "$ratio" "$goal" "$unit" "$met" "$*"
}

common=(-n 50 -w 10 -c 1)
echo "host: $(nproc) cores, $(uname -srm), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| figure | median | runs | memcpy GB/s/thread | handoff ns | busbw / memcpy, or time / handoff | target | met | command |"
echo "|---|---|---|---|---|---|---|---|---|"
row "all_reduce busbw @ 64 MiB, 2 ranks" busbw 8 -o all_reduce --ranks 2 -b 64M -e 64M -n 20 -w 5 -c 1
row "all_reduce busbw @ 1 MiB, 2 ranks" busbw 15 -o all_reduce --ranks 2 -b 1M -e 1M "${common[@]}"
row "all_reduce time @ 4 KiB, 2 ranks" time 1 -o all_reduce --ranks 2 -b 4K -e 4K -n 2000 -w 200 -c 1
row "all_gather busbw @ 64 MiB, 2 ranks" busbw 8 -o all_gather --ranks 2 -b 64M -e 64M -n 20 -w 5 -c 1
row "all_gather busbw @ 64 MiB, 2 ranks, in place" busbw 8 -o all_gather --ranks 2 -b 64M -e 64M -n 20 -w 5 -c 1 --in-place
row "reduce_scatter busbw @ 64 MiB, 2 ranks" busbw 8 -o reduce_scatter --ranks 2 -b 64M -e 64M -n 20 -w 5 -c 1
row "reduce_scatter busbw @ 64 MiB, 2 ranks, in place" busbw 8 -o reduce_scatter --ranks 2 -b 64M -e 64M -n 20 -w 5 -c 1 --in-place
row "all_to_all busbw @ 64 MiB, 2 ranks" busbw 8 -o all_to_all --ranks 2 -b 64M -e 64M -n 20 -w 5 -c 1
row "all_reduce time @ 4 KiB, 4 ranks" time 20 -o all_reduce --ranks 4 -b 4K -e 4K -n 2000 -w 200 -c 1
