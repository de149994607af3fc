#!/usr/bin/env bash
# The README's test command: installs build dependencies when missing, then runs every test
# (unit, integration, doc, and each bench once in test mode). Needs no GPU and no ../shared;
# tests that use ../shared/data (real tokenizer, MELD) say so and skip when it is absent.
# The server tests drive `merg serve` with the official openai/ollama Python clients, pinned in
# a virtual environment that scripts/py-clients.sh builds once (from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
MERG_PYTHON="$(bash scripts/py-clients.sh)"
export MERG_PYTHON MERG_REQUIRE_PY_CLIENTS=1
# Each step's wall time goes to stderr, so a slow CI run shows where its time went.
step() { local t=$SECONDS; "$@"; echo "test.sh: $((SECONDS - t))s for: $*" >&2; }
step cargo test --all-targets "$@"
# The library without the optional features (serve, hub, video) is not tested again here: its
# unit tests are the same code (a second build of every dependency took 7 minutes of CI for
# 9 s of tests), and CI's `cargo clippy --no-default-features --all-targets` compiles it.
# The kernels again at each lower level (MERG_CPU_KERNELS): on an AVX-512 machine the AVX2
# kernels run only here; at `portable` the block types fall back to candle's kernels.
for level in avx2 portable; do
  MERG_CPU_KERNELS=$level step cargo test --lib -- cpu:: layers::
  MERG_CPU_KERNELS=$level step cargo test --test gguf --test quant
done
# The device path, proven on the CPU (MERG_CPU_KERNELS=generic): no CPU kernel or host fast
# path at all (candle's ops alone; the engine and hybrid tests assert none ran), Qwen3.5's
# Gated DeltaNet rule as tensor operations with its state kept as tensors, every step's
# attention as one batched computation, sampling settled on the device (one read-back per
# step), against every family's goldens and the paged engines' tests.
MERG_CPU_KERNELS=generic step cargo test --test engine --test hybrid --test constrained --test parity
step cargo test --doc
