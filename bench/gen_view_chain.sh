#!/bin/bash
# Prints an IR graph with a chain of N views (each a view of the previous one), for the
# executor's planning time (`funcol run G --ranks 1`), which must stay near-linear in N:
#   waits: the chain starts at an all_reduce's result and every view is waited on (each wait
#          finds the collective at the chain's base);
#   casts: the chain starts at the input and every view is cast and then cat'ed alone (each
#          cast is checked for folding into its cat, which looks through the views).
# Usage: bench/gen_view_chain.sh waits|casts N > g.ir
set -euo pipefail
shape=${1:?usage: gen_view_chain.sh waits|casts N}
n=${2:?usage: gen_view_chain.sh waits|casts N}
echo 'graph @chain(%x: f32[4]) {'
prev='%x'
if [[ $shape == waits ]]; then
  echo '  %a = all_reduce(%x) {reduce_op = "sum", group = "world"}'
  prev='%a'
fi
last=''
for ((i = 0; i < n; i++)); do
  echo "  %v$i = view($prev) {shape = [4]}"
  case $shape in
    waits) echo "  %w$i = wait_tensor(%v$i)"; last="%w$i" ;;
    casts)
      echo "  %c$i = convert_element_type(%v$i) {dtype = f64}"
      echo "  %k$i = cat(%c$i) {dim = 0}"
      last="%k$i"
      ;;
    *) echo "gen_view_chain.sh: unknown shape '$shape' (waits or casts)" >&2; exit 2 ;;
  esac
  prev="%v$i"
done
echo "  return $last"
echo '}'
