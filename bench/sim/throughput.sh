#!/usr/bin/env bash
# Simulator throughput: one `sluice sim` process at --speed 0 (no delays), small non-stream
# requests over keep-alive, load generator on the same machine.
#
# Usage: bench/sim/throughput.sh [duration_seconds] [connections]
# Env: WRK_THREADS (load generator threads, default 1), SIM_THREADS (simulator serving threads,
#      default 2), SLUICE_BIN (binary to run, default target/release/sluice).
# Needs: wrk (https://github.com/wg/wrk). Builds the release binary if needed.
# Prints requests/s for GET /health (the cheapest route: the baseline of the same run) and for
# POST /v1/chat/completions on each personality, and the ratio chat/health.
set -euo pipefail

DURATION="${1:-10}"
CONNS="${2:-64}"
THREADS="${WRK_THREADS:-1}"
SIM_THREADS="${SIM_THREADS:-2}"
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BIN="${SLUICE_BIN:-$ROOT/target/release/sluice}"

command -v wrk >/dev/null || { echo "wrk is required" >&2; exit 1; }
if [ ! -x "$BIN" ]; then
    (cd "$ROOT" && cargo build --release --bin sluice)
fi

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

wait_up() {
    local url="$1"
    for _ in $(seq 1 100); do
        if curl -fsS -o /dev/null "$url"; then return 0; fi
        sleep 0.1
    done
    echo "simulator did not come up at $url" >&2
    return 1
}

rps() {
    # wrk prints "Requests/sec:  123456.78"
    awk '/Requests\/sec/ {print $2}'
}

run_kind() {
    local kind="$1" health="$2" chat_path="$3" lua="$4"
    local port; port="$(free_port)"
    "$BIN" sim --kind "$kind" --port "$port" --model m --speed 0 --threads "$SIM_THREADS" >/dev/null 2>&1 &
    local pid=$!
    trap 'kill "$pid" 2>/dev/null || true' RETURN
    wait_up "http://127.0.0.1:$port$health"
    # warm-up
    wrk -t"$THREADS" -c"$CONNS" -d2s "http://127.0.0.1:$port$health" >/dev/null
    local h c
    h="$(wrk -t"$THREADS" -c"$CONNS" -d"${DURATION}s" "http://127.0.0.1:$port$health" | rps)"
    c="$(wrk -t"$THREADS" -c"$CONNS" -d"${DURATION}s" -s "$lua" "http://127.0.0.1:$port$chat_path" | rps)"
    printf '%-7s GET %-8s %10s req/s   POST %-21s %10s req/s   ratio %s\n' \
        "$kind" "$health" "$h" "$chat_path" "$c" "$(awk -v a="$c" -v b="$h" 'BEGIN{printf "%.2f", a/b}')"
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

echo "sluice sim throughput: ${DURATION}s per run, ${CONNS} connections, ${THREADS} wrk thread(s), ${SIM_THREADS} sim thread(s), $(nproc) cores"
run_kind vllm /health /v1/chat/completions "$HERE/chat.lua"
run_kind tgi /health /v1/chat/completions "$HERE/chat.lua"
run_kind ollama / /v1/chat/completions "$HERE/chat.lua"
