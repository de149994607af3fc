#!/usr/bin/env bash
# Load benchmark of `merg serve` over loopback (scripts/bench_serve.py): requests/s and p50/p99
# latency at 1, 8 and 64 concurrent streaming clients, as ratios to 1 client, in one run.
# usage: scripts/bench-serve.sh [--model M] [extra merg serve flags...]
# Default model: the tiny test checkpoint (measures the server and batching, not the model).
set -euo pipefail
cd "$(dirname "$0")/.."
model=tests/fixtures/tiny-qwen2_5-vl
if [[ "${1:-}" == "--model" ]]; then model="$2"; shift 2; fi
bash scripts/install-deps.sh
python="$(bash scripts/py-clients.sh)"
cargo build --release --quiet
bin="${CARGO_TARGET_DIR:-target}/release/merg"
log="$(mktemp)"
"$bin" serve --model "$model" --port 0 --served-model-name bench --kv-memory blocks:2048 "$@" 2>"$log" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 600); do grep -q "listening on" "$log" && break; sleep 0.1; done
url="$(grep -o 'http://[^ ]*' "$log" | head -1)"
[[ -n "$url" ]] || { cat "$log" >&2; exit 1; }
"$python" scripts/bench_serve.py "$url" bench
