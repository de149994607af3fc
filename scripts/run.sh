#!/usr/bin/env bash
# The README's main command: builds merg (release) and runs it. With no arguments it answers a
# prompt about an image on the tiny bundled checkpoint; otherwise the arguments go to `merg`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
FEATURES=${MERG_FEATURES:-}
cargo build --release -q ${FEATURES:+--features "$FEATURES"}
if [ $# -eq 0 ]; then
  set -- generate --model tests/fixtures/tiny-qwen2_5-vl \
    --image tests/fixtures/media/img_a.png --prompt "How does the person in this picture feel?" \
    --max-new-tokens 16 --json
fi
exec target/release/merg "$@"
