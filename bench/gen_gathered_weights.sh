#!/bin/bash
# Prints an IR graph of FSDP's shape under `overlap{memory-budget-mb=...}`: one coalesced
# all_gather of N weights, then N layers, each a compute node and a reduce_scatter of its
# weight's square. Every reduce_scatter the pass hoists reads one result of the coalesced
# collective, so the time of a hoist must not grow with N (it did: O(N^2) in all).
# Usage: bench/gen_gathered_weights.sh N > g.ir
set -euo pipefail
n=${1:?usage: gen_gathered_weights.sh N}
weights=''
for ((i = 0; i < n; i++)); do weights+="${weights:+, }%w$i"; done
params=''
for ((i = 0; i < n; i++)); do params+=", %w$i: f32[4]"; done
echo "graph @gathered(%x: f32[8]$params) {"
echo "  %ag:$n = all_gather_into_tensor_coalesced($weights) {group_size = 2, group = \"world\"}"
for ((i = 0; i < n; i++)); do echo "  %f$i = wait_tensor(%ag#$i)"; done
outs=''
for ((i = 0; i < n; i++)); do
  echo "  %n$i = neg(%x)"
  echo "  %g$i = mul(%f$i, %f$i)"
  echo "  %rs$i = reduce_scatter_tensor(%g$i) {reduce_op = \"sum\", group_size = 2, group = \"world\"}"
  echo "  %s$i = wait_tensor(%rs$i)"
  outs+=", %n$i, %s$i"
done
echo "  return ${outs#, }"
echo '}'
