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
# report folder holds report.md and logs.tgz (a device call brings back at most 8 files).
# GPU_STEPS="info parity-f32 …" runs only the named steps (see run() for the names).
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

# same_tokens MERG: greedy and sampled ids of `merg generate` on tiny checkpoints and a GGUF file, --device cuda
# against --device cpu (f32 both); prints each pair and fails when any differ.
same_tokens() {
  local merg=$1 rc=0 fam mode out
  # The GGUF file (Q4_K/Q6_K blocks, candle's CUDA block kernels there): loading from a GGUF
  # onto the GPU.
  for fam in tiny-qwen2_5-vl tiny-qwen3_5 gguf/qwen2-vl-wide/wide-q4_k_m.gguf; do
    for mode in greedy sampled; do
      local args=(generate --model "tests/fixtures/$fam" --prompt "How was your day?" --max-new-tokens 24 --json --dtype f32)
      [ "$mode" = sampled ] && args+=(--temperature 1.3 --top-p 0.95 --seed 9)
      local cpu cuda
      cpu=$("$merg" "${args[@]}" --device cpu | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
      cuda=$("$merg" "${args[@]}" --device cuda | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
      if [ "$cpu" = "$cuda" ]; then
        out=same
      elif [ "${fam%.gguf}" != "$fam" ]; then
        # The tiny GGUF model's logits are near uniform (log-probs about -6.1 over 512 tokens),
        # and the GPU's block kernels quantize activations differently from the CPU's: its
        # tokens are shown, not required to match.
        out="DIFFERENT (near-uniform logits; not checked)"
      else
        out=DIFFERENT
        rc=1
      fi
      echo "$fam $mode tokens $out: cpu $cpu cuda $cuda"
    done
  done
  return $rc
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
  export MERG_FIXTURES_DIR=$PWD/tests/fixtures
  local b=(--device cuda --decode-tokens 64)
  local total
  total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  # GPU_STEPS picks steps by name (a device call may run a part, then the rest); default all.
  local steps=${GPU_STEPS:-info parity-f32 parity-bf16 sampling bench-qwen2.5-vl-7b bench-qwen3.5-9b bench-agents-7b plan-7b bench-qwen3.5-27b}
  for s in $steps; do
    case $s in
      info) step info "$bin/merg" info --model tests/fixtures/tiny-qwen2_5-vl ;;
      parity-f32) step parity-f32 env MERG_TEST_DEVICE=cuda "$bin/parity" --test-threads 1 matches_transformers ;;
      parity-bf16) step parity-bf16 env MERG_TEST_DEVICE=cuda "$bin/parity" --test-threads 1 bf16 ;;
      # The paged engine's device path (batched attention, delta rule as tensor ops, the
      # ranked head of a sampled row) against the same binary on the host's CPU.
      sampling) step sampling bash scripts/gpu-check.sh same-tokens "$bin/merg" ;;
      bench-qwen2.5-vl-7b) step "$s" "$bin/merg" bench --config models/qwen2.5-vl-7b-instruct.json "${b[@]}" --quant bf16,q4k --prompt-tokens 512 --batch 8 "${tok[@]}" ;;
      # No --batch for Qwen3.5: it needs the model's own tokenizer (248k tokens), not Qwen2's.
      bench-qwen3.5-9b) step "$s" "$bin/merg" bench --config models/qwen3.5-9b.json "${b[@]}" --quant bf16,q4k --prompt-tokens 512 ;;
      bench-agents-7b) step "$s" "$bin/merg" bench-agents --config models/qwen2.5-vl-7b-instruct.json "${tok[@]}" --device cuda --dialogues 4 --repeats 1 --new-tokens 16 ;;
      plan-7b) step "$s" "$bin/merg" plan --config models/qwen2.5-vl-7b-instruct.json --memory "${total}MiB" --dialogues 4 ;;
      # The paper's backbone (Qwen3.5 27B; it ran Q4_K_M): q4k here, in situ from dummy weights.
      bench-qwen3.5-27b) step "$s" "$bin/merg" bench --config models/qwen3.5-27b.json "${b[@]}" --quant q4k --prompt-tokens 512 ;;
      *) echo "gpu-check: unknown step $s" >&2 ;;
    esac
  done
  {
    echo
    echo 'Figures (from the logs beside this report):'
    echo '```'
    grep -E '^(roofline|decode|prefill|memory|weights|loading peak|fits|verdict|test result|test .* (ok|FAILED)|.*greedy|.* tokens (same|DIFFERENT)|.*logits rel)|"(cache_hit_fraction|wall_ratio|wall_s|dialogues_per_minute|device_memory_used_bytes)"' "$report"/*.log
    echo '```'
  } >> "$md"
  # A device call brings back at most 8 files: the logs travel as one archive.
  tar -czf "$report/logs.tgz" -C "$report" $(cd "$report" && ls ./*.log) && rm -f "$report"/*.log
  cat "$md"
}

case $mode in
  build) build ;;
  run) run ;;
  same-tokens) same_tokens "$2" ;;
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
