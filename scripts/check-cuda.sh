#!/usr/bin/env bash
# Compile guard for the `cuda` feature (no GPU needed): `cargo clippy --features cuda --all-targets`
# with warnings as errors (a check that also lints the CUDA-only code)
# with the CUDA 13.0 toolchain from PyPI that ../shared/gpu/setup-cuda-toolchain.sh installs
# (nvcc, cuBLAS, cuRAND, NVRTC wheels plus a stub libcuda). The toolchain is cached under
# ~/.cache/merg-cuda and rebuilt only when the recipe changes. Without ../shared (or
# $MERG_SHARED_DIR) the check says so and is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${MERG_SHARED_DIR:-../shared}
recipe=$shared/gpu/setup-cuda-toolchain.sh
if [ ! -f "$recipe" ]; then
  echo "cuda check SKIPPED: $recipe not found (the CUDA toolchain recipe lives in ../shared/gpu)"
  exit 0
fi
export TC=${TC:-$HOME/.cache/merg-cuda}
stamp=$(sha256sum "$recipe" | cut -d' ' -f1)
if [ ! -f "$TC/env.sh" ] || [ "$(cat "$TC/recipe.sha256" 2>/dev/null)" != "$stamp" ]; then
  echo "cuda check: installing the CUDA toolchain into $TC" >&2
  rm -rf "$TC"
  cargo fetch -q
  bash "$recipe"
  echo "$stamp" > "$TC/recipe.sha256"
fi
# shellcheck disable=SC1091
source "$TC/env.sh"
# candle-kernels' build script runs nvcc even for `cargo check`; one architecture (sm_90a).
CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} cargo clippy --features cuda --all-targets -- -D warnings
echo "cuda check: cargo clippy --features cuda --all-targets -- -D warnings passed"
