#!/usr/bin/env bash
# The GPU checklist in one command (../shared/gpu/README.md's manual steps, issue 27 item 5).
#
#   scripts/gpu-check.sh build   here, no GPU needed: builds `merg` and every family's parity
#                                test binary with the `cuda` feature (CUDA_COMPUTE_CAP, default
#                                90 = H100/H200) and packs them, xz-compressed, with the
#                                tokenizer and tests/memory.rs's widened GGUF files into .gpu/
#   scripts/gpu-check.sh run     on the GPU machine (the repository with .gpu/ carried along):
#                                parity on the GPU in f32 and bf16, `merg bench` on the
#                                Qwen2.5-VL 7B and Qwen3.5 9B configs (bf16 and q4k, dummy
#                                weights, decode as % of the GPU's copy bandwidth),
#                                `merg bench-agents`, `merg plan` beside the measured peak, and
#                                the host memory of loading a GGUF onto the GPU;
#                                writes $REPORT (default $OUT or gpu-report/) with report.md
#   scripts/gpu-check.sh         build, then run where a GPU is visible; without one it says so
#                                and exits 0 after the `cuda` compile check (scripts/check-cuda.sh)
#   scripts/gpu-check.sh stash   before a device call: moves the tracked files no step reads
#                                (other formats' GGUF fixtures, fonts, …) into .gpu-stash/, since
#                                a call carries the whole working tree and at most 64 MiB (the
#                                fixtures alone are over 50); prints what would travel
#   scripts/gpu-check.sh restore after the call: puts them back
#
# Each step runs under its own time limit and a failing step does not stop the others: the
# report lists every step's exit status. step_limit() bounds each (STEP_TIMEOUT overrides);
# DEADLINE (seconds) bounds the whole run, skipping the steps it leaves no time for. The
# report folder holds report.md and logs.tgz (a device call brings back at most 8 files).
# GPU_STEPS="info parity-f32 …" runs only the named steps (see run() for the names).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
pack=.gpu
# The test binaries whose goldens check the device path (MERG_TEST_DEVICE=cuda): every family.
parity_tests="parity gemma3 omni"
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
  mkdir -p "$pack"
  grep -qx "/$pack/" .git/info/exclude 2> /dev/null || echo "/$pack/" >> .git/info/exclude
  local t test_bin bins
  bins=$(mktemp -d)
  cp "$CARGO_TARGET_DIR/release/merg" "$bins/"
  for t in $parity_tests; do
    test_bin=$(cargo test --release "${features[@]}" --test "$t" --no-run --message-format=json 2> /dev/null |
      T=$t python3 -c 'import json,os,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == os.environ["T"] and m.get("executable"): print(m["executable"])')
    cp "$test_bin" "$bins/$t"
  done
  # One stream with a window wider than a binary: the binaries share candle's kernels and
  # most of merg, which then compress once (a device call carries at most 64 MiB).
  strip "$bins"/*
  tar -C "$bins" -cf - . | xz -T1 --lzma2=preset=6,dict=512MiB > "$pack/bins.tar.xz"
  rm -rf "$bins"
  # The widened Q4_K_M files of tests/memory.rs for the host-memory step (its layers repeat:
  # 150 MiB of file pack into a few). A CPU build: the test only writes files.
  local widened
  widened=$(mktemp -d)
  (unset CARGO_TARGET_DIR && MERG_WIDEN_OUT=$widened cargo test -q --test memory -- --ignored widened_q4_k_m_files)
  tar -C "$widened" -cf - . | xz -T0 -6 > "$pack/widened.tar.xz"
  rm -rf "$widened"
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

# host_memory MERG DIR: `merg bench` loading the small and the big widened Q4_K_M file onto
# the GPU: the host memory the big file's extra bytes cost while loading (issue 32 item 4: the
# load streams tensor by tensor, so the file is not held on the host beside the GPU's copy).
host_memory() {
  local f
  for f in small big; do
    "$1" bench --model "$2/$f/$f.gguf" --device cuda --prompt-tokens 4 --decode-tokens 2 --warmup 0 --no-roofline > "$2/$f.json" || return 1
  done
  python3 - "$2" << 'PY'
import json, os, sys
d, M = sys.argv[1], 1 << 20
mem = {f: json.load(open(f"{d}/{f}.json"))["memory"] for f in ("small", "big")}
size = {f: os.path.getsize(f"{d}/{f}/{f}.gguf") for f in mem}
for f, m in mem.items():
    p, a = m["peak_during_load"], m["after_load"]
    print(f"host memory {f}: file {size[f] / M:.0f} MiB; loading peak {p['total_bytes'] / M:.0f} MiB "
          f"(anonymous {p['anon_bytes'] / M:.0f}, file {p['file_bytes'] / M:.0f}); after load {(a['anon_bytes'] + a['file_bytes']) / M:.0f} MiB")
extra = mem["big"]["peak_during_load"]["total_bytes"] - mem["small"]["peak_during_load"]["total_bytes"]
print(f"host memory: {(size['big'] - size['small']) / M:.0f} MiB more file cost {extra / M:.0f} MiB more host memory at the loading peak")
PY
}

# The tracked files no step reads: every GGUF fixture but the Q4_K_M one same_tokens loads,
# goldens of preprocessing, audio and metrics, the report's font.
unneeded() {
  git ls-files tests/fixtures/gguf tests/fixtures/goldens/preprocess tests/fixtures/goldens/audio \
    tests/fixtures/goldens/bertscore tests/fixtures/goldens/metrics src/report/fonts |
    grep -v -e '^tests/fixtures/gguf/qwen2-vl-wide/wide-q4_k_m.gguf$' -e '^tests/fixtures/gguf/qwen2-vl-wide/mmproj' \
      -e '^tests/fixtures/gguf/qwen2-vl-wide/.*preprocessor_config.json$'
}

stash() {
  grep -qx "/.gpu-stash/" .git/info/exclude 2> /dev/null || echo "/.gpu-stash/" >> .git/info/exclude
  local f
  unneeded | while read -r f; do
    [ -f "$f" ] || continue
    mkdir -p ".gpu-stash/$(dirname "$f")" && mv "$f" ".gpu-stash/$f"
  done
  local tracked packed
  tracked=$(git ls-files -z | xargs -0 cat 2> /dev/null | wc -c)
  packed=$(cat "$pack"/* 2> /dev/null | wc -c)
  echo "gpu-check: $(((tracked + packed) >> 20)) MiB would travel (tracked $((tracked >> 20)), $pack $((packed >> 20))); the limit is 64. Run '$0 restore' after the call."
}

restore() {
  [ -d .gpu-stash ] || return 0
  (cd .gpu-stash && find . -type f) | while read -r f; do
    f=${f#./}
    mkdir -p "$(dirname "$f")" && mv ".gpu-stash/$f" "$f"
  done
  rm -rf .gpu-stash
  git status --short
}

# Seconds a step may take (STEP_TIMEOUT overrides them all): the H200's runs took well under.
step_limit() {
  case $1 in
    info | plan-*) echo 30 ;;
    bench-qwen3.5-27b | bench-agents-32b) echo 200 ;;
    *) echo 150 ;;
  esac
}

# parity BIN FILTER: each family's parity test binary on the GPU, tests matching FILTER.
parity() {
  local rc=0 t
  for t in $parity_tests; do
    MERG_TEST_DEVICE=cuda "$1/$t" --test-threads 1 "$2" || rc=1
  done
  return $rc
}

run() {
  local report=${REPORT:-${OUT:-gpu-report}} bin=/tmp/merg-gpu
  mkdir -p "$report" "$bin"
  local libs
  libs=$(cuda_libs)
  export LD_LIBRARY_PATH=${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  xz -dc "$pack/bins.tar.xz" | tar -C "$bin" -xf -
  [ -f "$pack/tokenizer.json.xz" ] && xz -dc "$pack/tokenizer.json.xz" > "$bin/tokenizer.json"
  mkdir -p "$bin/widened" && xz -dc "$pack/widened.tar.xz" | tar -C "$bin/widened" -xf -
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
  # peak memory polled every 100 ms beside it. With DEADLINE (seconds from here) a step gets
  # at most what is left, and one that would get under 15 s is skipped: the report then still
  # comes back whole inside a device call's limit.
  local run_t0=$SECONDS
  step() {
    local name=$1
    shift
    local poll=$report/$name.mem t0=$SECONDS lim=${STEP_TIMEOUT:-$(step_limit "$name")}
    if [ -n "${DEADLINE:-}" ]; then
      local left=$((DEADLINE - (SECONDS - run_t0) - 10))
      if [ "$left" -lt 15 ]; then
        echo "| $name | skipped (deadline) | 0 | |" >> "$md"
        return
      fi
      [ "$left" -lt "$lim" ] && lim=$left
    fi
    (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; sleep 0.1; done) > "$poll" 2> /dev/null &
    local poller=$!
    echo "== $name: $*" >&2
    timeout "$lim" "$@" > "$report/$name.log" 2>&1
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
  local agents=(bench-agents "${tok[@]}" --device cuda --dialogues 4 --repeats 1 --new-tokens 16)
  local total
  total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  # GPU_STEPS picks steps by name (a device call may run a part, then the rest); default all.
  # Most telling first: correctness, then the 7B, then the larger models.
  local steps=${GPU_STEPS:-info parity-f32 sampling parity-bf16 host-memory bench-qwen2.5-vl-7b bench-agents-7b bench-qwen3.5-9b plan-7b bench-agents-32b bench-qwen3.5-27b}
  for s in $steps; do
    case $s in
      info) step info "$bin/merg" info --model tests/fixtures/tiny-qwen2_5-vl ;;
      parity-f32) step parity-f32 bash scripts/gpu-check.sh parity "$bin" matches_transformers ;;
      parity-bf16) step parity-bf16 bash scripts/gpu-check.sh parity "$bin" bf16 ;;
      # The paged engine's device path (batched attention, delta rule as tensor ops, the
      # ranked head of a sampled row) against the same binary on the host's CPU.
      sampling) step sampling bash scripts/gpu-check.sh same-tokens "$bin/merg" ;;
      bench-qwen2.5-vl-7b) step "$s" "$bin/merg" bench --config models/qwen2.5-vl-7b-instruct.json "${b[@]}" --quant bf16,q4k --prompt-tokens 512 --batch 8 "${tok[@]}" ;;
      # No --batch for Qwen3.5: it needs the model's own tokenizer (248k tokens), not Qwen2's.
      bench-qwen3.5-9b) step "$s" "$bin/merg" bench --config models/qwen3.5-9b.json "${b[@]}" --quant bf16,q4k --prompt-tokens 512 ;;
      bench-agents-7b) step "$s" "$bin/merg" "${agents[@]}" --config models/qwen2.5-vl-7b-instruct.json ;;
      host-memory) step "$s" bash scripts/gpu-check.sh host-memory "$bin/merg" "$bin/widened" ;;
      # The largest dense Qwen3-VL (66 GB of bf16): the KV pool sized from what the load left.
      bench-agents-32b) step "$s" "$bin/merg" "${agents[@]}" --config models/qwen3-vl-32b-instruct.json ;;
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
    grep -E '^(roofline|decode|prefill|memory|host memory|weights|loading peak|fits|verdict|test result|test .* (ok|FAILED)|.*greedy|.* tokens (same|DIFFERENT)|.*logits rel)|"(cache_hit_fraction|wall_ratio|wall_s|dialogues_per_minute|device_memory_used_bytes)"' "$report"/*.log
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
  parity) parity "$2" "$3" ;;
  host-memory) host_memory "$2" "$3" ;;
  stash) stash ;;
  restore) restore ;;
  all)
    if has_gpu; then
      build && run
    else
      echo "gpu-check: no GPU visible (nvidia-smi lists none); checking that the cuda feature compiles instead"
      bash scripts/check-cuda.sh
    fi
    ;;
  *) echo "usage: $0 [build|run|stash|restore]" >&2 && exit 2 ;;
esac
