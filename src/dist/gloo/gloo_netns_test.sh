#!/usr/bin/env bash
# Multi-host for real: two ranks of a gloo program in two network namespaces, each with its own
# network stack, joined through a bridge in a third namespace that also runs the Redis server
# they meet at. Namespaces, links and processes are removed on exit.
#
#   gloo_netns_test.sh PROGRAM ARGS...   (exit 77: skipped where namespaces cannot be made)
set -uo pipefail

skip() { echo "gloo_netns_test.sh: SKIP: $*"; exit 77; }
[ "$(id -u)" -eq 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "iproute2 (ip) is not installed"
command -v redis-server >/dev/null || skip "redis-server is not installed"

tag="fc$$"
hub="${tag}h"
ns=("${tag}a" "${tag}b")
ips=(10.213.0.1 10.213.0.2)
hub_ip=10.213.0.254
port=6379
pids=()
work=$(mktemp -d)
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  for n in "${ns[@]}" "$hub"; do ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null; done
  for n in "${ns[@]}" "$hub"; do ip netns del "$n" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$hub" 2>/dev/null || skip "cannot create network namespaces here (ip netns add failed)"
ip netns exec "$hub" ip link set lo up
ip netns exec "$hub" ip link add br0 type bridge
ip netns exec "$hub" ip addr add "$hub_ip/24" dev br0
ip netns exec "$hub" ip link set br0 up
for i in 0 1; do
  ip netns add "${ns[$i]}"
  ip netns exec "${ns[$i]}" ip link set lo up
  # veth pair: eth0 inside the rank's namespace, its peer on the hub's bridge.
  ip link add "${tag}v$i" type veth peer name "${tag}p$i"
  ip link set "${tag}v$i" netns "${ns[$i]}"
  ip link set "${tag}p$i" netns "$hub"
  ip netns exec "${ns[$i]}" ip link set "${tag}v$i" name eth0
  ip netns exec "${ns[$i]}" ip addr add "${ips[$i]}/24" dev eth0
  ip netns exec "${ns[$i]}" ip link set eth0 up
  ip netns exec "$hub" ip link set "${tag}p$i" master br0
  ip netns exec "$hub" ip link set "${tag}p$i" up
done

ip netns exec "$hub" redis-server --port "$port" --bind "$hub_ip" --save '' --appendonly no \
  --protected-mode no --dir "$work" >"$work/redis.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  if ip netns exec "${ns[0]}" redis-cli -h "$hub_ip" -p "$port" ping 2>/dev/null | grep -q PONG
  then
    break
  fi
  sleep 0.1
done
ip netns exec "${ns[0]}" redis-cli -h "$hub_ip" -p "$port" ping | grep -q PONG ||
  { echo "redis in the hub namespace is unreachable:"; cat "$work/redis.log"; exit 1; }

for i in 0 1; do
  ip netns exec "${ns[$i]}" env RANK=$i WORLD_SIZE=2 FUNCOL_STORE="redis://$hub_ip:$port" \
    "$@" >"$work/rank$i.log" 2>&1 &
  pids+=($!)
done
status=0
deadline=$((SECONDS + 500))
for i in 0 1; do
  pid=${pids[$((i + 1))]}
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "gloo_netns_test.sh: rank $i still running at the deadline" >&2
    status=1
    break
  fi
  wait "$pid" || { echo "gloo_netns_test.sh: rank $i failed" >&2; status=1; }
done
for i in 0 1; do sed "s/^/[rank $i ${ips[$i]}] /" "$work/rank$i.log"; done
[ $status -eq 0 ] && echo "gloo_netns_test.sh: 2 ranks in separate network namespaces passed"
exit $status
