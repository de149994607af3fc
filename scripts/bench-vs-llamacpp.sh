#!/usr/bin/env bash
# merg vs llama.cpp on the CPU, on the SAME GGUF files: prefill and decode tokens/s at batch 1.
# llama.cpp is the one the MERG paper ran, built from the pinned llama-cpp-python sdist
# (scripts/requirements-gguf.txt); the files are random-weight, seeded (scripts/make_bench_gguf.py),
# quantized by llama.cpp's own llama-quantize. A user's benchmark, not a test. See --help.
set -Eeuo pipefail

usage() {
  cat <<'EOF'
usage: scripts/bench-vs-llamacpp.sh [--level native|avx2] [--gguf FILE...] [-p P] [-n N]
                                    [-t THREADS] [-r REPS] [--out DIR] [--prepare-only]

Runs llama-bench and `merg bench` on each GGUF file (engines alternate file by file) and
prints a table of prefill / decode tokens/s and merg ÷ llama.cpp ratios, then one of peak
resident memory (anonymous + file-backed) and time from start to the first token.

  --level native  llama.cpp with GGML_NATIVE=ON, merg with its detected kernels (default)
  --level avx2    llama.cpp for AVX2+FMA+F16C only (no AVX-512, VNNI or AMX), merg with
                  MERG_CPU_KERNELS=avx2: the same instruction set on both sides
  --gguf FILE...  text-model .gguf files to measure (each with its mmproj-*.gguf beside it,
                  which merg needs); default: random-weight Qwen2.5-VL files made here:
                  3B text width with 8 layers at F32, BF16, Q8_0 and Q4_K_M, the
                  Qwen2.5-0.5B text shape at Q4_K_M, and Qwen3.5-27B's widths and
                  vocabulary on 2 layers at Q4_K_M
  -p P            prompt tokens (default 256)      -n N   decode tokens (default 32)
  -t THREADS      threads for both (default: nproc) -r R  repetitions of each (default 3)
  --out DIR       where the raw JSON goes (default target/bench-vs-llamacpp/<time>)
  --prepare-only  build llama.cpp and make the files, then stop (run it niced while the
                  machine is busy with other work; the measuring run then finds both cached)

Caches (MERG_CACHE, default ~/.cache/merg): llama.cpp-<version>-<level>/ (built once),
bench-venv/ (pinned gguf + numpy, cmake when the system has none), bench-gguf/ (the files).
Needs: a C/C++ compiler, python3, cargo, and PyPI (first run only).
EOF
}

die() { echo "bench-vs-llamacpp: $*" >&2; exit 1; }
# set -e stops on any failing command; say which, instead of ending silently.
trap 'echo "bench-vs-llamacpp: failed (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${MERG_CACHE:-$HOME/.cache/merg}
LEVEL=native P=256 N=32 THREADS=$(nproc) REPS=3 OUT="" GGUFS=() PREPARE=0
while (($#)); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --level) LEVEL=${2:?--level needs native or avx2}; shift 2 ;;
    --gguf) shift; while (($#)) && [[ $1 != -* ]]; do GGUFS+=("$(realpath "$1")"); shift; done
            ((${#GGUFS[@]})) || die "--gguf needs at least one file" ;;
    -p) P=${2:?}; shift 2 ;;
    -n) N=${2:?}; shift 2 ;;
    -t) THREADS=${2:?}; shift 2 ;;
    -r) REPS=${2:?}; shift 2 ;;
    --out) OUT=${2:?}; shift 2 ;;
    --prepare-only) PREPARE=1; shift ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
[[ $LEVEL == native || $LEVEL == avx2 ]] || die "--level must be native or avx2, not '$LEVEL'"
for f in "${GGUFS[@]}"; do [[ -f $f ]] || die "no such file: $f"; done

# Pins come from one place, the fixture generator's requirements.
pin() { grep -m1 "^$1==" "$ROOT/scripts/requirements-gguf.txt" | cut -d= -f3; }
LLAMA_VER=$(pin llama-cpp-python) GGUF_VER=$(pin gguf)
[[ -n $LLAMA_VER && -n $GGUF_VER ]] || die "cannot read the pins in scripts/requirements-gguf.txt"

# --- Python tools: pinned gguf-py + numpy (and cmake if missing) in a venv -----------------
VENV=$CACHE/bench-venv PY=$CACHE/bench-venv/bin/python
mkdir -p "$CACHE"
if ! "$PY" -c "import numpy, importlib.metadata as m; assert m.version('gguf') == '$GGUF_VER'" 2>/dev/null; then
  echo "== python venv $VENV (gguf==$GGUF_VER, numpy)"
  python3 -m venv "$VENV" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
  "$VENV/bin/pip" install -q "gguf==$GGUF_VER" numpy || die "pip install gguf==$GGUF_VER numpy failed"
fi
CMAKE=$(command -v cmake || true)
if [[ -z $CMAKE ]]; then
  [[ -x $VENV/bin/cmake ]] || { echo "== no cmake on PATH: installing it into $VENV"; "$VENV/bin/pip" install -q cmake || die "pip install cmake failed"; }
  CMAKE=$VENV/bin/cmake
fi

# --- llama.cpp, built once per level from the pinned sdist's vendor/llama.cpp ---------------
LDIR=$CACHE/llama.cpp-$LLAMA_VER-$LEVEL
if [[ $LEVEL == native ]]; then
  LFLAGS=(-DGGML_NATIVE=ON)
else  # x86-64 AVX2 tier (ggml's "haswell" variant): nothing above AVX2 + FMA + F16C + BMI2.
  LFLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
          -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
          -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
if [[ ! -x $LDIR/bin/llama-bench || ! -x $LDIR/bin/llama-quantize ]]; then
  echo "== building llama.cpp $LLAMA_VER ($LEVEL) in $LDIR (once; several minutes)"
  SDIST=$CACHE/sdist/llama_cpp_python-$LLAMA_VER.tar.gz
  if [[ ! -f $SDIST ]]; then
    # --no-binary for this package only: build deps (cmake, scikit-build-core) stay wheels.
    "$VENV/bin/pip" download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_VER" -d "$CACHE/sdist" \
      || die "pip download llama-cpp-python==$LLAMA_VER failed"
  fi
  rm -rf "$LDIR" && mkdir -p "$LDIR/bin"
  tar -xzf "$SDIST" -C "$LDIR" || die "cannot unpack $SDIST"
  SRC=$LDIR/llama_cpp_python-$LLAMA_VER/vendor/llama.cpp
  [[ -f $SRC/CMakeLists.txt ]] || die "$SDIST has no vendor/llama.cpp"
  t0=$(date +%s)
  # Static, CPU only, no network code (LLAMA_CURL is the older name of the HTTP switch), no
  # tests/examples/server: only the two tools below are built.
  "$CMAKE" -S "$SRC" -B "$LDIR/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_CCACHE=OFF "${LFLAGS[@]}" > "$LDIR/cmake.log" 2>&1 || die "cmake configure failed: see $LDIR/cmake.log"
  "$CMAKE" --build "$LDIR/build" --target llama-bench llama-quantize -j "$(nproc)" > "$LDIR/build.log" 2>&1 \
    || die "llama.cpp build failed: see $LDIR/build.log"
  cp "$LDIR/build/bin/llama-bench" "$LDIR/build/bin/llama-quantize" "$LDIR/bin/"
  # The instruction-set flags ggml-cpu was compiled with: the build's real level.
  isa=$(grep -rhoE --include=flags.make -e '-m(arch=native|avx[0-9a-z_]*|fma|f16c|bmi2|amx[a-z_-]*)\b' "$LDIR/build/ggml/src" | sort -u | tr '\n' ' ')
  printf 'level=%s\nflags=%s\ncompiled=%s\nbuild_s=%s\nbuilt=%s\n' "$LEVEL" "${LFLAGS[*]}" "$isa" "$(( $(date +%s) - t0 ))" "$(date -u +%FT%TZ)" > "$LDIR/build-info.txt"
  rm -rf "$LDIR/llama_cpp_python-$LLAMA_VER"  # sources: 400 MB we do not need again
fi
source <(grep -E '^(compiled|build_s|built)=' "$LDIR/build-info.txt" | sed "s/=\(.*\)/='\1'/")
LLAMA_LEVEL="$LEVEL (ggml-cpu compiled with: ${compiled:-?})"
echo "== llama.cpp $LLAMA_VER: $LDIR ($LLAMA_LEVEL; built ${built:-?} in ${build_s:-?} s)"

# --- the GGUF files --------------------------------------------------------------------------
if ((${#GGUFS[@]} == 0)); then
  TOK=${MERG_DATA_DIR:-$ROOT/../shared/data}/qwen2-tokenizer/tokenizer.json
  [[ -f $TOK ]] || TOK=$ROOT/tests/fixtures/tiny-qwen2_5-vl/tokenizer.json
  # config stem : formats to measure
  # The 27B-width file (2 layers, 248k vocabulary, untied) shows memory is not a constant ratio.
  for spec in "qwen2.5-vl-3b-text-8l:f32 bf16 q8_0 q4_k_m" "qwen2.5-0.5b-text-shape:q4_k_m" "qwen2.5-vl-27b-width-2l:q4_k_m"; do
    stem=${spec%%:*} cfg=$ROOT/models/dummy-${spec%%:*}.json
    # The directory name hashes what decides the bytes, so a changed generator makes new files.
    key=$(cat "$ROOT/scripts/make_bench_gguf.py" "$cfg" "$TOK" | sha256sum | cut -c1-10)
    dir=$CACHE/bench-gguf/$stem-$key
    if [[ ! -f $dir/$stem-f32.gguf ]]; then
      echo "== writing $stem F32 + projector into $dir"
      rm -rf "$dir.tmp"
      "$PY" "$ROOT/scripts/make_bench_gguf.py" --config "$cfg" --tokenizer "$TOK" --out "$dir.tmp" || die "make_bench_gguf.py failed"
      rm -rf "$dir" && mv "$dir.tmp" "$dir"
    fi
    for fmt in ${spec#*:}; do
      f=$dir/$stem-$fmt.gguf
      if [[ ! -f $f ]]; then
        echo "== llama-quantize $stem -> ${fmt^^}"
        "$LDIR/bin/llama-quantize" "$dir/$stem-f32.gguf" "$f.tmp" "${fmt^^}" "$THREADS" > "$f.log" 2>&1 \
          || die "llama-quantize ${fmt^^} failed: see $f.log"
        mv "$f.tmp" "$f"
      fi
      GGUFS+=("$f")
    done
  done
fi

if ((PREPARE)); then
  printf '== prepared (nothing measured): %s\n' "${GGUFS[@]}"
  exit 0
fi

# --- merg --------------------------------------------------------------------------------------
echo "== cargo build --release"
(cd "$ROOT" && cargo build --release -q) || die "cargo build --release failed"
MERG=${CARGO_TARGET_DIR:-$ROOT/target}/release/merg
[[ -x $MERG ]] || die "no merg binary at $MERG"
MERG_ENV=(RAYON_NUM_THREADS="$THREADS" RUST_LOG=merg::cpu=info)
[[ $LEVEL == avx2 ]] && MERG_ENV+=(MERG_CPU_KERNELS=avx2)

OUT=${OUT:-$ROOT/target/bench-vs-llamacpp/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
echo "== raw results in $OUT"

gguf_format() {  # general.file_type as llama.cpp names it (F32, BF16, Q8_0, Q4_K_M)
  # Reads the header only: gguf-py's GGUFReader parses all 151,936 tokens (~20 s a file).
  "$PY" - "$1" <<'PYEOF'
import struct, sys, gguf
f = open(sys.argv[1], "rb")
_, _, _, nkv = struct.unpack("<4sIQQ", f.read(24))
size = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def string():
    return f.read(struct.unpack("<Q", f.read(8))[0])
for _ in range(nkv):
    key, (t,) = string(), struct.unpack("<I", f.read(4))
    if key == b"general.file_type":
        sys.exit(print(gguf.LlamaFileType(struct.unpack("<I", f.read(4))[0]).name.split("_", 1)[1]))
    if t == 8:
        string()
    elif t == 9:
        et, n = struct.unpack("<IQ", f.read(12))
        if et == 8:
            for _ in range(n): string()
        else:
            f.seek(size[et] * n, 1)
    else:
        f.seek(size[t], 1)
print("?")
PYEOF
}

# --- runs: per file both engines, the first engine alternating from file to file --------------
# Resident memory of both engines is sampled alike (scripts/peak_rss.py: anonymous and
# file-backed, every 20 ms): llama-bench's whole run, merg's first repetition (same prompt and
# decode lengths). Start to first token: each engine loads the file and computes one prompt
# token, no warm-up, twice (the faster counts: the page cache is warm by then).
PEAK=("$PY" "$ROOT/scripts/peak_rss.py")
run_llama() {  # file name
  "${PEAK[@]}" "$OUT/$2.llama.mem.json" -- "$LDIR/bin/llama-bench" -m "$1" -p "$P" -n "$N" -t "$THREADS" -r "$REPS" -o json \
    > "$OUT/$2.llama.json" 2> "$OUT/$2.llama.log" || die "llama-bench failed on $1: see $OUT/$2.llama.log"
  for i in 1 2; do
    "${PEAK[@]}" "$OUT/$2.llama.start.$i.json" -- "$LDIR/bin/llama-bench" -m "$1" -p 1 -n 0 -t "$THREADS" -r 1 --no-warmup \
      > /dev/null 2>> "$OUT/$2.llama.log" || die "llama-bench failed on $1: see $OUT/$2.llama.log"
  done
}
run_merg() {  # file name format
  local extra=()
  # A BF16 file: compute in bf16 as llama.cpp does (merg's CPU default would widen it to f32).
  [[ $3 == BF16 ]] && extra=(--dtype bf16)
  for ((i = 1; i <= REPS; i++)); do
    local peak=()
    ((i == 1)) && peak=("${PEAK[@]}" "$OUT/$2.merg.mem.json" --)
    "${peak[@]}" env "${MERG_ENV[@]}" "$MERG" bench --model "$1" --prompt-tokens "$P" --decode-tokens "$N" --no-roofline "${extra[@]}" \
      > "$OUT/$2.merg.$i.out" 2> "$OUT/$2.merg.$i.log" || die "merg bench failed on $1: see $OUT/$2.merg.$i.log"
  done
  for i in 1 2; do
    "${PEAK[@]}" "$OUT/$2.merg.start.$i.json" -- env "${MERG_ENV[@]}" "$MERG" bench --model "$1" --prompt-tokens 1 --decode-tokens 1 \
      --warmup 0 --no-roofline "${extra[@]}" > /dev/null 2>> "$OUT/$2.merg.start.log" || die "merg bench failed on $1: see $OUT/$2.merg.start.log"
  done
}
# Other work on the machine skews both engines (llama.cpp's spinning threads most): say how busy it was.
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
k=0 ROWS=()
for f in "${GGUFS[@]}"; do
  name=$(basename "$f" .gguf) fmt=$(gguf_format "$f")
  echo "-- $name ($fmt)"
  if ((k++ % 2 == 0)); then run_llama "$f" "$name"; run_merg "$f" "$name" "$fmt"; else run_merg "$f" "$name" "$fmt"; run_llama "$f" "$name"; fi
  ROWS+=("$f|$fmt")
done

# --- the table -------------------------------------------------------------------------------
MERG_LEVEL=$(grep -ohm1 'cpu kernels: .*' "$OUT"/*.merg.1.log | head -1 | sed 's/^cpu kernels: //' || true)
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
# VMs often hide the marketing name ("AMD EPYC"); family/model still tell the generation.
cpu+=" (family $(grep -m1 '^cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' '), model $(grep -m1 '^model[[:space:]]*:' /proc/cpuinfo | cut -d: -f2 | tr -d ' '))"
flags=$(grep -m1 '^flags' /proc/cpuinfo)
isa=portable
for x in avx2 fma avx512f avx512_bf16 avx512_vnni avx_vnni amx_tile; do [[ " $flags " == *" $x "* ]] && isa+=" $x"; done
"$PY" - "$OUT" "$cpu" "${isa#portable }" "$LLAMA_LEVEL" "${MERG_LEVEL:-unknown} (MERG_CPU_KERNELS=${LEVEL/native/unset})" "$P" "$N" "$THREADS" "$REPS" \
  "$LOAD0 / $(cut -d' ' -f1-3 /proc/loadavg)" "${ROWS[@]}" <<'PYEOF' | tee "$OUT/table.txt"
import json, os, re, statistics as st, sys
out, cpu, isa, llama_level, merg_level, P, N, T, R, load, rows = *sys.argv[1:11], sys.argv[11:]

def merg_record(path):
    # `merg bench` prints log lines, then one pretty JSON object per weight format: take the last.
    text, dec, rec = open(path).read(), json.JSONDecoder(), None
    for m in re.finditer(r"^\{", text, re.M):
        try:
            rec = dec.raw_decode(text[m.start():])[0]
        except ValueError:
            pass
    if rec is None:
        sys.exit(f"no JSON record in {path}")
    return rec

def fmt(s):  # mean ± stdev over the repetitions
    return f"{f'{st.mean(s):.2f} ±{st.stdev(s) if len(s) > 1 else 0:.2f}':>15}"

print(f"CPU: {cpu} | ISA: {isa} | threads {T} | prompt {P} tokens, decode {N} tokens, {R} repetitions each")
print(f"load average (1, 5, 15 min) before / after the runs: {load}")
print(f"llama.cpp build: {llama_level}")
print(f"merg kernels:    {merg_level}")
hdr = f"{'file':<34} {'format':<8} {'GiB':>6} | {'llama.cpp pp':>15} {'merg pp':>15} {'ratio':>6} | {'llama.cpp tg':>15} {'merg tg':>15} {'ratio':>6}"
print(hdr); print("-" * len(hdr))
for row in rows:
    f, kind = row.rsplit("|", 1)
    name = os.path.basename(f)[:-5]
    llama = json.load(open(f"{out}/{name}.llama.json"))
    lpp = next(x for x in llama if x["n_prompt"] > 0 and x["n_gen"] == 0)["samples_ts"]
    ltg = next(x for x in llama if x["n_gen"] > 0 and x["n_prompt"] == 0)["samples_ts"]
    recs = [merg_record(f"{out}/{name}.merg.{i}.out") for i in range(1, int(R) + 1)]
    json.dump(recs, open(f"{out}/{name}.merg.json", "w"), indent=1)
    mpp = [x["prefill_tokens_per_s"] for x in recs]; mtg = [x["decode_tokens_per_s"] for x in recs]
    print(f"{name:<34} {kind:<8} {os.path.getsize(f) / 2**30:6.2f} | {fmt(lpp)} {fmt(mpp)} {st.mean(mpp) / st.mean(lpp):6.2f} | {fmt(ltg)} {fmt(mtg)} {st.mean(mtg) / st.mean(ltg):6.2f}")
print("tok/s, mean ± stdev; ratio = merg ÷ llama.cpp (above 1: merg faster). pp = prefill of the prompt,")
print("tg = decode: llama-bench times it from an empty context; merg decodes after its prompt. Both engines run one")
print("untimed warm-up prefill first (llama-bench's default, merg bench --warmup 1).")
print()
hdr = f"{'file':<34} {'MiB':>6} | {'llama.cpp peak (anon + file)':>30} {'merg peak (anon + file)':>30} {'ratio':>6} | {'llama.cpp start':>15} {'merg start':>10} {'ratio':>6}"
print(hdr); print("-" * len(hdr))
for row in rows:
    f = row.rsplit("|", 1)[0]
    name = os.path.basename(f)[:-5]
    mem = {e: json.load(open(f"{out}/{name}.{e}.mem.json")) for e in ("llama", "merg")}
    start = {e: min(json.load(open(f"{out}/{name}.{e}.start.{i}.json"))["wall_s"] for i in (1, 2)) for e in ("llama", "merg")}
    cell = lambda m: f"{m['peak_total_mib']:.0f} ({m['peak_anon_mib']:.0f} + {m['peak_file_mib']:.0f})"
    print(f"{name:<34} {os.path.getsize(f) / 2**20:6.0f} | {cell(mem['llama']):>30} {cell(mem['merg']):>30} {mem['merg']['peak_total_mib'] / mem['llama']['peak_total_mib']:6.2f} |"
          f" {start['llama']:13.2f} s {start['merg']:8.2f} s {start['merg'] / start['llama']:6.2f}")
print("peak = the most resident at once over the run, sampled every 20 ms (anonymous and file-backed peaks apiece);")
print("ratio = merg ÷ llama.cpp (below 1: merg holds less, starts sooner). start = process start to the first")
print("prompt token computed (load + one token, no warm-up; the faster of two runs, page cache warm).")
PYEOF
