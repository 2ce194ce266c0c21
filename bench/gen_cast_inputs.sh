#!/bin/bash
# Prints an IR graph whose loss sums one input plus N inputs that reach it only through a cast
# to i32 and back: autodiff gives the N inputs zeros (no gradient flows through the casts).
# Usage: bench/gen_cast_inputs.sh N > casts.ir
set -euo pipefail
n=${1:?usage: gen_cast_inputs.sh N}
inputs='%y: f32[2]'
for ((i = 0; i < n; i++)); do inputs+=", %x$i: f32[2]"; done
echo "graph @casts($inputs) {"
echo '  %acc0 = sum(%y)'
for ((i = 0; i < n; i++)); do
  echo "  %c$i = convert_element_type(%x$i) {dtype = i32}"
  echo "  %f$i = convert_element_type(%c$i) {dtype = f32}"
  echo "  %s$i = sum(%f$i)"
  echo "  %acc$((i + 1)) = add(%acc$i, %s$i)"
done
echo "  return %acc$n"
echo '}'
