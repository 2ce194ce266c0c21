#!/bin/bash
# Prints an IR graph of N all-gathers where bucketing must drop nearly every member: each
# all-gather's wait feeds an all_reduce, and the next all-gather's input is the wait of another
# all_reduce issued after it, so no two all-gathers can merge without reordering the
# all_reduces. Usage: bench/gen_drop_chain.sh N > chain.ir
set -euo pipefail
n=${1:?usage: gen_drop_chain.sh N}
echo 'graph @chain(%x: f32[4], %y: f32[4]) {'
prev='%x'
outs=()
for ((i = 0; i < n; i++)); do
  echo "  %g$i = all_gather_into_tensor($prev) {group_size = 2, group = \"world\"}"
  echo "  %w$i = wait_tensor(%g$i)"
  echo "  %a$i = all_reduce(%w$i) {reduce_op = \"sum\", group = \"world\"}"
  echo "  %b$i = wait_tensor(%a$i)"
  echo "  %c$i = all_reduce(%y) {reduce_op = \"max\", group = \"world\"}"
  echo "  %d$i = wait_tensor(%c$i)"
  prev="%d$i"
  outs+=("%b$i")
done
(IFS=,; echo "  return ${outs[*]}" | sed 's/,/, /g')
echo '}'
