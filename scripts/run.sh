#!/usr/bin/env bash
# The README's main command: builds merg (release) and runs it. With no arguments it runs the
# five-agent pipeline (`merg respond`) on the example dialogue and its keyframes with the tiny
# bundled checkpoint (random weights: the reply is noise, the trace shows the machinery);
# otherwise the arguments go to `merg`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
FEATURES=${MERG_FEATURES:-}
cargo build --release -q ${FEATURES:+--features "$FEATURES"}
if [ $# -eq 0 ]; then
  set -- respond --model tests/fixtures/tiny-qwen2_5-vl \
    --dialogue examples/dialogue.json --memory examples/memory.jsonl \
    --max-new-tokens 240 --max-field-chars 16 --trace example.trace.json
fi
exec "${CARGO_TARGET_DIR:-target}/release/merg" "$@"
