#!/usr/bin/env bash
# Load benchmark of `merg serve` over loopback (scripts/bench_serve.py): requests/s and p50/p99
# latency at 1, 8 and 64 concurrent streaming clients, as ratios to 1 client, in one run; the
# rows as JSON and drawn by `merg plot serve-load` (SVG and PNG) under --out.
# usage: scripts/bench-serve.sh [--model M] [--out DIR] [extra merg serve flags...]
# Default model: the tiny test checkpoint (measures the server and batching, not the model).
# Default --out: $CARGO_TARGET_DIR (or target)/bench-serve.
set -euo pipefail
cd "$(dirname "$0")/.."
model=tests/fixtures/tiny-qwen2_5-vl
out="${CARGO_TARGET_DIR:-target}/bench-serve"
while [[ "${1:-}" == "--model" || "${1:-}" == "--out" ]]; do
  case $1 in
    --model) model="$2" ;;
    --out) out="$2" ;;
  esac
  shift 2
done
bash scripts/install-deps.sh
python="$(bash scripts/py-clients.sh)"
cargo build --release --quiet
bin="${CARGO_TARGET_DIR:-target}/release/merg"
log="$(mktemp)"
"$bin" serve --model "$model" --port 0 --served-model-name bench --kv-memory blocks:2048 "$@" 2>"$log" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$log" "$log.out"' EXIT
for _ in $(seq 600); do grep -q "listening on" "$log" && break; sleep 0.1; done
url="$(grep -o 'http://[^ ]*' "$log" | head -1)"
[[ -n "$url" ]] || { cat "$log" >&2; exit 1; }
"$python" scripts/bench_serve.py "$url" bench | tee "$log.out"
mkdir -p "$out"
sed -n 's/^json: //p' "$log.out" > "$out/bench-serve.json"
rm -f "$log.out"
for ext in svg png; do "$bin" plot serve-load "$out/bench-serve.json" --out "$out/bench-serve.$ext"; done
