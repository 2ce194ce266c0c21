#!/bin/bash
# Prints an IR graph with a chain of N views (each a view of the previous one), for the
# executor's planning time (`funcol run G --ranks 1`), which must stay near-linear in N:
#   waits: the chain starts at an all_reduce's result and every view is waited on (each wait
#          finds the collective at the chain's base);
#   casts: the chain starts at the input and every view is cast and then cat'ed alone (each
#          cast is checked for folding into its cat, which looks through the views);
#   hoists: the chain starts at a waited all_reduce's result and N all_reduces of its end
#          follow, each after a node they can be hoisted over, for `overlap` under a budget
#          (`funcol opt G -p 'overlap{memory-budget-mb=1000}'`): each hoist finds the
#          collective the chain's end is a view of, which must not walk the chain again.
# Usage: bench/gen_view_chain.sh waits|casts|hoists N > g.ir
set -euo pipefail
shape=${1:?usage: gen_view_chain.sh waits|casts|hoists N}
n=${2:?usage: gen_view_chain.sh waits|casts|hoists N}
if [[ $shape == hoists ]]; then
  echo 'graph @chain(%x: f32[4], %y: f32[4]) {'
  echo '  %a = all_reduce(%x) {reduce_op = "sum", group = "world"}'
  echo '  %v0 = wait_tensor(%a)'
  for ((i = 1; i <= n; i++)); do echo "  %v$i = view(%v$((i - 1))) {shape = [4]}"; done
  outs=''
  for ((i = 0; i < n; i++)); do
    echo "  %n$i = neg(%y)"
    echo "  %c$i = all_reduce(%v$n) {reduce_op = \"sum\", group = \"world\"}"
    echo "  %w$i = wait_tensor(%c$i)"
    outs+=", %n$i, %w$i"
  done
  echo "  %s = add(%v$n, %v$n)"
  echo "  return %s$outs"
  echo '}'
  exit 0
fi
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
    *) echo "gen_view_chain.sh: unknown shape '$shape' (waits, casts or hoists)" >&2; exit 2 ;;
  esac
  prev="%v$i"
done
echo "  return $last"
echo '}'
