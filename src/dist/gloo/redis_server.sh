# Sourced by the gloo tests that rendezvous through Redis. start_redis NAME: starts a private
# Redis server on a free port (exit 77, skipped, when redis-server is not installed), sets
# `port` and `work` (a temporary directory), and stops the server and removes `work` on exit.
start_redis() {
  local name=$1
  if ! command -v redis-server >/dev/null; then
    echo "$name: SKIP: redis-server is not installed"
    exit 77
  fi
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
  work=$(mktemp -d)
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$work" \
    >"$work/redis.log" 2>&1 &
  redis_pid=$!
  trap 'kill "$redis_pid" 2>/dev/null; wait "$redis_pid" 2>/dev/null; rm -rf "$work"' EXIT
  # Ready when it answers PING (bounded: 10 s).
  for _ in $(seq 100); do
    if redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; then return; fi
    sleep 0.1
  done
  echo "$name: redis-server did not start:"
  cat "$work/redis.log"
  exit 1
}
