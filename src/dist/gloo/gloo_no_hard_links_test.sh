#!/usr/bin/env bash
# A store directory on a file system without hard links (vfat, some FUSE ones), which the
# preload library no_hard_links stands in for: the directory store falls back to Gloo's look
# and rename, and a 2-rank job runs. Each rank says at exit how many links it was refused,
# which proves the library was loaded.
#
#   gloo_no_hard_links_test.sh NO_HARD_LINKS.so FUNCOL GRAPH.ir
set -uo pipefail
shim=$1
funcol=$2
graph=$3
out=$(LD_PRELOAD=$shim "$funcol" run "$graph" --backend gloo --ranks 2 --outputs json 2>&1)
status=$?
if [ "$status" != 0 ] || ! grep -q '"rank": 1' <<<"$out" ||
    [ "$(grep -c 'no_hard_links: refused' <<<"$out")" -lt 2 ]; then
  echo "gloo_no_hard_links_test.sh: exit $status; output:"
  echo "$out"
  exit 1
fi
echo "gloo_no_hard_links_test.sh: the job ran with link() refused on both ranks"
