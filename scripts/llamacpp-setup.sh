# Sourced by the side-by-side scripts (bench-vs-llamacpp.sh, bench-agents-vs-llamacpp.sh):
# the pinned Python tools, llama.cpp built once per level from the pinned llama-cpp-python
# sdist (llama-bench, llama-quantize, llama-server), and the random-weight GGUF files.
# Expects ROOT, CACHE, LEVEL, THREADS and a `die` function; sets VENV, PY, LDIR, LLAMA_LEVEL.

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
TOOLS=(llama-bench llama-quantize llama-server)
have_tools() { for t in "${TOOLS[@]}"; do [[ -x $LDIR/bin/$t ]] || return 1; done; }
if ! have_tools; then
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
  # tests, examples or web UI: only the three tools below are built.
  "$CMAKE" -S "$SRC" -B "$LDIR/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_CCACHE=OFF "${LFLAGS[@]}" > "$LDIR/cmake.log" 2>&1 || die "cmake configure failed: see $LDIR/cmake.log"
  "$CMAKE" --build "$LDIR/build" --target "${TOOLS[@]}" -j "$(nproc)" > "$LDIR/build.log" 2>&1 \
    || die "llama.cpp build failed: see $LDIR/build.log"
  for t in "${TOOLS[@]}"; do cp "$LDIR/build/bin/$t" "$LDIR/bin/"; done
  # The instruction-set flags ggml-cpu was compiled with: the build's real level.
  isa=$(grep -rhoE --include=flags.make -e '-m(arch=native|avx[0-9a-z_]*|fma|f16c|bmi2|amx[a-z_-]*)\b' "$LDIR/build/ggml/src" | sort -u | tr '\n' ' ')
  printf 'level=%s\nflags=%s\ncompiled=%s\nbuild_s=%s\nbuilt=%s\n' "$LEVEL" "${LFLAGS[*]}" "$isa" "$(( $(date +%s) - t0 ))" "$(date -u +%FT%TZ)" > "$LDIR/build-info.txt"
  rm -rf "$LDIR/llama_cpp_python-$LLAMA_VER"  # sources: 400 MB we do not need again
fi
source <(grep -E '^(compiled|build_s|built)=' "$LDIR/build-info.txt" | sed "s/=\(.*\)/='\1'/")
LLAMA_LEVEL="$LEVEL (ggml-cpu compiled with: ${compiled:-?})"
echo "== llama.cpp $LLAMA_VER: $LDIR ($LLAMA_LEVEL; built ${built:-?} in ${build_s:-?} s)"

# --- the GGUF files --------------------------------------------------------------------------
# bench_ggufs "STEM:FMT FMT" ...: makes models/dummy-STEM.json's F32 file and projector, then
# each format by llama-quantize; appends the paths to GGUFS.
bench_ggufs() {
  TOK=${MERG_DATA_DIR:-$ROOT/../shared/data}/qwen2-tokenizer/tokenizer.json
  [[ -f $TOK ]] || TOK=$ROOT/tests/fixtures/tiny-qwen2_5-vl/tokenizer.json
  for spec in "$@"; do
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
}
