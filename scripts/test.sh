#!/usr/bin/env bash
# The README's test command: installs build dependencies when missing, then runs every test
# (unit, integration, doc, and each bench once in test mode). Needs no GPU and no ../shared;
# tests that use ../shared/data (real tokenizer, MELD) say so and skip when it is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cargo test --all-targets "$@"
cargo test --doc
