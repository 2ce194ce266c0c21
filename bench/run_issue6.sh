#!/usr/bin/env bash
# Runs the issue-6 benchmarks (threads vs mpi vs gloo, 2 ranks) and prints the RESULTS.md rows.
#
# Usage: bench/run_issue6.sh            (after `make build`; run on a quiet machine)
#   FUNCOL=path/to/funcol   the command (default build/bin/funcol; needs mpi and gloo built in)
#   REPEATS=N               runs per figure; the median is reported (default 3)
#   RANKS=N                 ranks (default 2)
#   N_4K, N_1M, N_64M       timed iterations at each size (default 500, 50, 10)
#
# One `funcol bench -o all` run per (backend, size, repeat); the repeats are interleaved
# (threads, mpi, gloo, threads, ...) so a change in the machine's load hits every backend alike.
# 4 KiB is reported as time (us, lower is better), 1 MiB and 64 MiB as busbw (GB/s, higher is
# better). Every run checks its results (-c 1); a wrong value or a failure stops the script.
set -euo pipefail

FUNCOL=${FUNCOL:-build/bin/funcol}
REPEATS=${REPEATS:-3}
RANKS=${RANKS:-2}
BACKENDS=(threads mpi gloo)
SIZES=(4K 1M 64M)
OPS=(all_reduce all_gather reduce_scatter all_to_all broadcast)
if [[ ! -x $FUNCOL ]]; then
  echo "run_issue6.sh: $FUNCOL not found; run 'make build' first or set FUNCOL" >&2
  exit 1
fi

# Timed iterations per size (warmup: a tenth, at least 2): enough for a stable mean, few enough
# for a loaded machine, where one 4 KiB collective on a process backend can take milliseconds.
N_4K=${N_4K:-500}
N_1M=${N_1M:-50}
N_64M=${N_64M:-10}
iters_for() {
  local n
  case $1 in
    4K) n=$N_4K ;;
    1M) n=$N_1M ;;
    *) n=$N_64M ;;
  esac
  echo "-n $n -w $(((n / 10) > 2 ? n / 10 : 2))"
}

median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for ((rep = 0; rep < REPEATS; rep++)); do
  for size in "${SIZES[@]}"; do
    for backend in "${BACKENDS[@]}"; do
      # shellcheck disable=SC2046
      args=(-o all --backend "$backend" --ranks "$RANKS" -b "$size" -e "$size" $(iters_for "$size")
            -c 1)
      if ! out=$("$FUNCOL" bench "${args[@]}" 2>&1); then
        echo "run_issue6.sh: '$FUNCOL bench ${args[*]}' failed:" >&2
        echo "$out" >&2
        exit 1
      fi
      # "op time busbw" per data row; the op comes from the "# <op>" line above its rows.
      echo "$out" | awk -v b="$backend" -v s="$size" '
        /^# (all_reduce|all_gather|reduce_scatter|all_to_all|broadcast)$/ {op = $2}
        !/^#/ && NF >= 10 {print b, s, op, $6, $8}' >> "$tmp/rows"
      echo "$out" |
        sed -n "s/^# memcpy reference: .*, \([0-9.]*\) GB\/s per thread.*/$backend \1/p" \
          >> "$tmp/memcpy"
    done
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# value BACKEND SIZE OP: the median (time for 4K, busbw otherwise) and every run's value.
value() {
  local col=5
  [[ $2 == 4K ]] && col=4
  local vals
  vals=$(awk -v b="$1" -v s="$2" -v o="$3" -v c="$col" '$1 == b && $2 == s && $3 == o {print $c}' \
    "$tmp/rows")
  printf '%s (%s)' "$(echo "$vals" | median)" "$(echo "$vals" | tr '\n' ' ' | sed 's/ $//')"
}

echo "host: $(nproc) cores, $(uname -srm), load before $load_before, after $load_after"
echo "command: FUNCOL=$FUNCOL REPEATS=$REPEATS RANKS=$RANKS N_4K=$N_4K N_1M=$N_1M" \
  "N_64M=$N_64M bench/run_issue6.sh"
printf 'memcpy GB/s per thread (median of the runs):'
for backend in "${BACKENDS[@]}"; do
  printf ' %s %s' "$backend" "$(awk -v b="$backend" '$1 == b {print $2}' "$tmp/memcpy" | median)"
done
echo
echo
echo "| op | size | metric | threads | mpi | gloo |"
echo "|---|---|---|---|---|---|"
for op in "${OPS[@]}"; do
  for size in "${SIZES[@]}"; do
    metric="busbw GB/s"
    [[ $size == 4K ]] && metric="time us"
    row="| $op | $size | $metric |"
    for backend in "${BACKENDS[@]}"; do row+=" $(value "$backend" "$size" "$op") |"; done
    echo "$row"
  done
done
echo
echo "Each cell: the median, then every run's value. Runs: funcol bench -o all --backend B" \
  "--ranks $RANKS -b S -e S -c 1 with $(iters_for 4K) (4K), $(iters_for 1M) (1M)," \
  "$(iters_for 64M) (64M)."
