#!/usr/bin/env bash
# Every figure of the "Quiet-machine figures" section of bench/RESULTS.md, in one run (after make build).
cd "$(dirname "$0")/.."
echo "== uptime"; uptime
echo "== bucketing_bench --sizes 1000,10000,100000"; build/bin/bucketing_bench --sizes 1000,10000,100000
echo "== ir_bench --repeat 3"; build/bin/ir_bench --repeat 3
echo "== executor_bench"; build/bin/executor_bench
echo "== fusion_bench --ranks 2"; build/bin/fusion_bench --ranks 2
echo "== fusion_bench --ranks 2 --mode custom_ops"; build/bin/fusion_bench --ranks 2 --mode custom_ops
for b in mpi gloo; do for m in default custom_ops; do echo "== fusion_bench --backend $b --ranks 2 --mode $m"; build/bin/fusion_bench --backend $b --ranks 2 --mode $m; done; done
echo "== uptime"; uptime
echo "== run_issue2.sh REPEATS=1"; REPEATS=1 bench/run_issue2.sh
echo "== latency_bench"; build/bin/latency_bench
echo "== train 32x64"; build/bin/funcol train --ranks 4 --layers 32 --hidden 64 --batch 16 --steps 200 --json
echo "== train 32x64 no-overlap"; build/bin/funcol train --ranks 4 --layers 32 --hidden 64 --batch 16 --steps 200 --no-overlap --json
echo "== train 4x1024"; build/bin/funcol train --ranks 4 --layers 4 --hidden 1024 --batch 16 --steps 20 --json
echo "== uptime"; uptime
for b in mpi gloo; do echo "== train 32x64 --backend $b"; build/bin/funcol train --ranks 4 --layers 32 --hidden 64 --batch 16 --steps 50 --backend $b --json; done
echo "== uptime"; uptime
