#!/usr/bin/env bash
# The GPU checklist in one command (../shared/gpu/README.md's manual steps, issue 27 item 5).
#
#   scripts/gpu-check.sh build   here, no GPU needed: builds `merg` and the parity test binary
#                                with the `cuda` feature (CUDA_COMPUTE_CAP, default 90 = H100/H200)
#                                and packs them, xz-compressed, with the tokenizer into .gpu/
#   scripts/gpu-check.sh run     on the GPU machine (the repository with .gpu/ carried along):
#                                parity on the GPU in f32 and bf16, `merg bench` on the
#                                Qwen2.5-VL 7B and Qwen3.5 9B configs (bf16 and q4k, dummy
#                                weights, decode as % of the GPU's copy bandwidth),
#                                `merg bench-agents`, and `merg plan` beside the measured peak;
#                                writes $REPORT (default $OUT or gpu-report/) with report.md
#   scripts/gpu-check.sh         build, then run where a GPU is visible; without one it says so
#                                and exits 0 after the `cuda` compile check (scripts/check-cuda.sh)
#
# Each step runs under its own time limit and a failing step does not stop the others: the
# report lists every step's exit status. STEP_TIMEOUT (seconds, default 150) bounds each. The
# report folder holds at most 8 files (7 logs and report.md), what a device call brings back.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
pack=.gpu
has_gpu() { command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; }

build() {
  set -e
  export TC=${TC:-$HOME/.cache/merg-cuda}
  # check-cuda.sh installs the pinned toolchain into $TC when it is missing.
  [ -f "$TC/env.sh" ] || bash scripts/check-cuda.sh
  # shellcheck disable=SC1091
  source "$TC/env.sh"
  export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
  # Without `video`: GPU machines carry no ffmpeg libraries (keyframes and images still work).
  # Nor `serve` or `hub`, which no step below uses (GPU_FEATURES=cuda,serve,hub adds them).
  local features=(--no-default-features --features "${GPU_FEATURES:-cuda}")
  cargo build --release "${features[@]}" --bin merg
  local test_bin
  test_bin=$(cargo test --release "${features[@]}" --test parity --no-run --message-format=json 2> /dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "parity" and m.get("executable"): print(m["executable"])')
  mkdir -p "$pack"
  grep -qx "/$pack/" .git/info/exclude 2> /dev/null || echo "/$pack/" >> .git/info/exclude
  xz -T0 -6 -c "$CARGO_TARGET_DIR/release/merg" > "$pack/merg.xz"
  xz -T0 -6 -c "$test_bin" > "$pack/parity.xz"
  local tok=${MERG_DATA_DIR:-../shared/data}/qwen2-tokenizer/tokenizer.json
  if [ -f "$tok" ]; then xz -T0 -6 -c "$tok" > "$pack/tokenizer.json.xz"; fi
  du -sh "$pack"/*
  set +e
}

# The CUDA 13 libraries the binary links, from the machine's torch virtual environment.
cuda_libs() {
  local py sp
  for py in /opt/torch/.venv/bin/python3 python3; do
    sp=$($py -c 'import site; print(site.getsitepackages()[0])' 2> /dev/null) || continue
    ls -d "$sp"/nvidia/*/lib > /dev/null 2>&1 && { ls -d "$sp"/nvidia/*/lib | paste -sd:; return; }
  done
}

run() {
  local report=${REPORT:-${OUT:-gpu-report}} t=${STEP_TIMEOUT:-150} bin=/tmp/merg-gpu
  mkdir -p "$report" "$bin"
  local libs
  libs=$(cuda_libs)
  export LD_LIBRARY_PATH=${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  for f in merg parity tokenizer.json; do
    [ -f "$pack/$f.xz" ] && xz -dc "$pack/$f.xz" > "$bin/$f"
  done
  chmod +x "$bin/merg" "$bin/parity"
  local md=$report/report.md
  {
    echo "# merg GPU check, $(date -u +%F' '%H:%M) UTC"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) ($(nproc) cores); merg $(git rev-parse --short HEAD 2> /dev/null)"
    echo '```'
    echo
    echo '| step | exit | seconds | peak GPU MiB (nvidia-smi) |'
    echo '|---|---|---|---|'
  } > "$md"
  # step NAME CMD...: runs CMD under the time limit, its log in $report/NAME.log, the GPU's
  # peak memory polled every 100 ms beside it.
  step() {
    local name=$1
    shift
    local poll=$report/$name.mem t0=$SECONDS
    (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; sleep 0.1; done) > "$poll" 2> /dev/null &
    local poller=$!
    echo "== $name: $*" >&2
    timeout "$t" "$@" > "$report/$name.log" 2>&1
    local rc=$?
    kill "$poller" 2> /dev/null
    local peak
    peak=$(sort -n "$poll" | tail -1)
    rm -f "$poll"
    echo "| $name | $rc | $((SECONDS - t0)) | ${peak:-?} |" >> "$md"
    tail -3 "$report/$name.log" >&2
  }
  local tok=(--tokenizer "$bin/tokenizer.json")
  [ -f "$bin/tokenizer.json" ] || tok=()
  export MERG_FIXTURES_DIR=$PWD/tests/fixtures MERG_TEST_DEVICE=cuda
  step info "$bin/merg" info --model tests/fixtures/tiny-qwen2_5-vl
  step parity-f32 "$bin/parity" --test-threads 1 matches_transformers
  step parity-bf16 "$bin/parity" --test-threads 1 bf16
  unset MERG_TEST_DEVICE
  local b=(--device cuda --decode-tokens 64 --quant bf16,q4k)
  step bench-qwen2.5-vl-7b "$bin/merg" bench --config models/qwen2.5-vl-7b-instruct.json "${b[@]}" --prompt-tokens 512 --batch 8 "${tok[@]}"
  # Qwen3.5's delta rule still runs on the host (issue 27): a shorter prompt.
  step bench-qwen3.5-9b "$bin/merg" bench --config models/qwen3.5-9b.json "${b[@]}" --prompt-tokens 256
  step bench-agents-7b "$bin/merg" bench-agents --config models/qwen2.5-vl-7b-instruct.json "${tok[@]}" --device cuda --dialogues 4 --repeats 1 --new-tokens 16
  local total
  total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  step plan-7b "$bin/merg" plan --config models/qwen2.5-vl-7b-instruct.json --memory "${total}MiB" --dialogues 4
  {
    echo
    echo 'Figures (from the logs beside this report):'
    echo '```'
    grep -E '^(roofline|decode|prefill|memory|weights|loading peak|fits|verdict|test result|test .* (ok|FAILED)|.*greedy|.*logits rel)|"(cache_hit_fraction|wall_ratio|wall_s|dialogues_per_minute|device_memory_used_bytes)"' "$report"/*.log
    echo '```'
  } >> "$md"
  cat "$md"
}

case $mode in
  build) build ;;
  run) run ;;
  all)
    if has_gpu; then
      build && run
    else
      echo "gpu-check: no GPU visible (nvidia-smi lists none); checking that the cuda feature compiles instead"
      bash scripts/check-cuda.sh
    fi
    ;;
  *) echo "usage: $0 [build|run]" >&2 && exit 2 ;;
esac
