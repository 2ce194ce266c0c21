#!/bin/bash
# Prints an IR graph of 2N all-gathers, N of them issued at the top (as `overlap` hoists them),
# for bucketing with a cap of two members (`cap-mb=0.00006103515625`, 64 bytes) so that each
# bucket pairs a hoisted all-gather with one issued later. Two shapes:
#   region: the hoisted one's wait is used before the later one's input exists, so every bucket
#           is placed by reordering (a window of a few nodes; the span from its first member to
#           its last wait is the whole graph);
#   chain:  the later ones read a chain of compute, so every dependency check starts from a
#           bucket whose first member is at the top, above the whole chain.
# Usage: bench/gen_hoisted.sh region|chain N > g.ir
set -euo pipefail
shape=${1:?usage: gen_hoisted.sh region|chain N}
n=${2:?usage: gen_hoisted.sh region|chain N}
ag() { echo "  %$1 = all_gather_into_tensor($2) {group_size = 2, group = \"world\"}"; }
echo 'graph @hoisted(%a: f32[4], %b: f32[4]) {'
for ((i = 0; i < n; i++)); do ag "a$i" '%a'; done
outs=()
case $shape in
  region)
    for ((i = 0; i < n; i++)); do
      echo "  %wa$i = wait_tensor(%a$i)"
      echo "  %r$i = relu(%wa$i)"
      echo "  %m$i = neg(%b)"
      ag "b$i" "%m$i"
      echo "  %wb$i = wait_tensor(%b$i)"
      outs+=("%r$i" "%wb$i")
    done
    ;;
  chain)
    prev='%b'
    for ((i = 0; i < n; i++)); do
      echo "  %h$i = neg($prev)"
      ag "b$i" "%h$i"
      prev="%h$i"
    done
    for ((i = 0; i < n; i++)); do
      echo "  %wa$i = wait_tensor(%a$i)"
      echo "  %wb$i = wait_tensor(%b$i)"
      outs+=("%wa$i" "%wb$i")
    done
    ;;
  *)
    echo "gen_hoisted.sh: unknown shape '$shape' (region or chain)" >&2
    exit 2
    ;;
esac
(IFS=,; echo "  return ${outs[*]}" | sed 's/,/, /g')
echo '}'
