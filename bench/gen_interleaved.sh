#!/bin/bash
# Prints an IR graph of N pairs of all-gathers in two interleaved families: every %a's wait
# feeds an all_reduce, every %b's input is the wait of another all_reduce issued after it. Not
# all of them can merge into one collective without reordering the all_reduces, but each
# family can: bucket-all-gather should leave two collectives.
# Usage: bench/gen_interleaved.sh N > pairs.ir
set -euo pipefail
n=${1:?usage: gen_interleaved.sh N}
echo 'graph @pairs(%p: f32[16], %q: f32[64]) {'
outs=()
for ((i = 0; i < n; i++)); do
  echo "  %a$i = all_gather_into_tensor(%p) {group_size = 4, group = \"world\"}"
  echo "  %wa$i = wait_tensor(%a$i)"
  echo "  %u$i = neg(%wa$i)"
  echo "  %r$i = all_reduce(%u$i) {reduce_op = \"sum\", group = \"world\"}"
  echo "  %wr$i = wait_tensor(%r$i)"
  echo "  %s$i = all_reduce(%q) {reduce_op = \"sum\", group = \"world\"}"
  echo "  %ws$i = wait_tensor(%s$i)"
  echo "  %v$i = narrow(%ws$i) {dim = 0, start = 0, length = 16}"
  echo "  %b$i = all_gather_into_tensor(%v$i) {group_size = 4, group = \"world\"}"
  echo "  %wb$i = wait_tensor(%b$i)"
  outs+=("%wr$i" "%wb$i")
done
(IFS=,; echo "  return ${outs[*]}" | sed 's/,/, /g')
echo '}'
