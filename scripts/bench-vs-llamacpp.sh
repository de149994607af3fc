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
                                    [--formats "FMT..."]

Runs llama-bench and `merg bench` on each GGUF file (taking turns repetition by repetition) and
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
  --formats "FMT..."  instead of that default, the 3B-text-width file in these llama-quantize
                  types only (e.g. "q5_k_m q4_0": Q5_K_M is Q5_K with Q6_K, Q4_0 the 32-value
                  blocks), made the same way
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
LEVEL=native P=256 N=32 THREADS=$(nproc) REPS=3 OUT="" GGUFS=() PREPARE=0 FORMATS=
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
    --formats) FORMATS=${2:?--formats needs a list of llama-quantize types}; shift 2
               [[ $FORMATS =~ ^[A-Za-z0-9_\ ]+$ ]] || die "--formats: '$FORMATS' is not a list of llama-quantize types (like \"q5_k_m q4_0\")" ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
[[ $LEVEL == native || $LEVEL == avx2 ]] || die "--level must be native or avx2, not '$LEVEL'"
for f in "${GGUFS[@]}"; do [[ -f $f ]] || die "no such file: $f"; done

# shellcheck source=scripts/llamacpp-setup.sh
source "$ROOT/scripts/llamacpp-setup.sh"
if [[ -n $FORMATS ]]; then
  ((${#GGUFS[@]} == 0)) || die "--formats makes its own files: give it or --gguf, not both"
  bench_ggufs "qwen2.5-vl-3b-text-8l:${FORMATS,,}"
elif ((${#GGUFS[@]} == 0)); then
  # config stem : formats to measure
  # The 27B-width file (2 layers, 248k vocabulary, untied) shows memory is not a constant ratio.
  bench_ggufs "qwen2.5-vl-3b-text-8l:f32 bf16 q8_0 q4_k_m" "qwen2.5-0.5b-text-shape:q4_k_m" "qwen2.5-vl-27b-width-2l:q4_k_m"
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

# --- runs: per file, the engines take turns repetition by repetition ------------------------------
# This host's memory bandwidth can move by a third within minutes; interleaving one llama-bench
# and one `merg bench` per repetition (the first engine alternating) exposes both to the same
# drift, so one run's ratios hold where engine-after-engine blocks would not.
# Resident memory of both engines is sampled alike (scripts/peak_rss.py: anonymous and
# file-backed, every 20 ms) over each engine's first repetition (a prompt and a decode after
# it: merg's run, llama-bench's decode at depth P). Start to first token: each engine loads the file and computes one prompt token,
# no warm-up, twice (the faster counts: the page cache is warm by then).
PEAK=("$PY" "$ROOT/scripts/peak_rss.py")
llama_rep() {  # file name repetition
  local peak=()
  (($3 == 1)) && peak=("${PEAK[@]}" "$OUT/$2.llama.mem.json" --)
  "$LDIR/bin/llama-bench" -m "$1" -p "$P" -n 0 -t "$THREADS" -r 1 -o json \
    > "$OUT/$2.llama.$3.pp.json" 2>> "$OUT/$2.llama.log" || die "llama-bench failed on $1: see $OUT/$2.llama.log"
  # Decode after a context of the prompt's length (-d), as merg decodes after its prompt: at
  # a long prompt an empty-context decode skips most of the attention.
  "${peak[@]}" "$LDIR/bin/llama-bench" -m "$1" -p 0 -n "$N" -d "$P" -t "$THREADS" -r 1 -o json \
    > "$OUT/$2.llama.$3.tg.json" 2>> "$OUT/$2.llama.log" || die "llama-bench failed on $1: see $OUT/$2.llama.log"
}
llama_start() {  # file name
  for i in 1 2; do
    "${PEAK[@]}" "$OUT/$2.llama.start.$i.json" -- "$LDIR/bin/llama-bench" -m "$1" -p 1 -n 0 -t "$THREADS" -r 1 --no-warmup \
      > /dev/null 2>> "$OUT/$2.llama.log" || die "llama-bench failed on $1: see $OUT/$2.llama.log"
  done
}
merg_args() {  # format: extra `merg bench` arguments
  # A BF16 file: compute in bf16 as llama.cpp does (merg's CPU default would widen it to f32).
  [[ $1 == BF16 ]] && echo --dtype bf16 || true
}
merg_rep() {  # file name format repetition
  local peak=()
  (($4 == 1)) && peak=("${PEAK[@]}" "$OUT/$2.merg.mem.json" --)
  # shellcheck disable=SC2046  # merg_args prints whole words
  "${peak[@]}" env "${MERG_ENV[@]}" "$MERG" bench --model "$1" --prompt-tokens "$P" --decode-tokens "$N" --no-roofline $(merg_args "$3") \
    > "$OUT/$2.merg.$4.out" 2> "$OUT/$2.merg.$4.log" || die "merg bench failed on $1: see $OUT/$2.merg.$4.log"
}
merg_start() {  # file name format
  for i in 1 2; do
    # shellcheck disable=SC2046
    "${PEAK[@]}" "$OUT/$2.merg.start.$i.json" -- env "${MERG_ENV[@]}" "$MERG" bench --model "$1" --prompt-tokens 1 --decode-tokens 1 \
      --warmup 0 --no-roofline $(merg_args "$3") > "$OUT/$2.merg.start.$i.out" 2>> "$OUT/$2.merg.start.log" || die "merg bench failed on $1: see $OUT/$2.merg.start.log"
  done
}
# Other work on the machine skews both engines (llama.cpp's spinning threads most): say how busy it was.
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
k=0 ROWS=()
for f in "${GGUFS[@]}"; do
  name=$(basename "$f" .gguf) fmt=$(gguf_format "$f")
  echo "-- $name ($fmt)"
  for ((i = 1; i <= REPS; i++)); do
    if (((k + i) % 2)); then llama_rep "$f" "$name" "$i"; merg_rep "$f" "$name" "$fmt" "$i"
    else merg_rep "$f" "$name" "$fmt" "$i"; llama_rep "$f" "$name" "$i"; fi
  done
  llama_start "$f" "$name"; merg_start "$f" "$name" "$fmt"
  k=$((k + 1)) ROWS+=("$f|$fmt")
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
    llama = [x for i in range(1, int(R) + 1) for t in ("pp", "tg") for x in json.load(open(f"{out}/{name}.llama.{i}.{t}.json"))]
    json.dump(llama, open(f"{out}/{name}.llama.json", "w"), indent=1)
    lpp = [t for x in llama if x["n_prompt"] > 0 and x["n_gen"] == 0 for t in x["samples_ts"]]
    ltg = [t for x in llama if x["n_gen"] > 0 and x["n_prompt"] == 0 for t in x["samples_ts"]]
    recs = [merg_record(f"{out}/{name}.merg.{i}.out") for i in range(1, int(R) + 1)]
    json.dump(recs, open(f"{out}/{name}.merg.json", "w"), indent=1)
    mpp = [x["prefill_tokens_per_s"] for x in recs]; mtg = [x["decode_tokens_per_s"] for x in recs]
    print(f"{name:<34} {kind:<8} {os.path.getsize(f) / 2**30:6.2f} | {fmt(lpp)} {fmt(mpp)} {st.mean(mpp) / st.mean(lpp):6.2f} | {fmt(ltg)} {fmt(mtg)} {st.mean(mtg) / st.mean(ltg):6.2f}")
print("tok/s, mean ± stdev; ratio = merg ÷ llama.cpp (above 1: merg faster). pp = prefill of the prompt,")
print("tg = decode after a context of the prompt's length on both (llama-bench -d P; merg decodes after its prompt).")
print("Both engines run one untimed warm-up first (llama-bench's default, merg bench --warmup 1).")
print()
hdr = f"{'file':<34} {'MiB':>6} | {'llama.cpp peak (anon + file)':>30} {'merg peak (anon + file)':>30} {'ratio':>6} | {'llama.cpp start':>15} {'merg start':>10} {'ratio':>6}"
print(hdr); print("-" * len(hdr))
for row in rows:
    f = row.rsplit("|", 1)[0]
    name = os.path.basename(f)[:-5]
    mem = {e: json.load(open(f"{out}/{name}.{e}.mem.json")) for e in ("llama", "merg")}
    start = {e: min(json.load(open(f"{out}/{name}.{e}.start.{i}.json"))["wall_s"] for i in (1, 2)) for e in ("llama", "merg")}
    # merg's own clock from process start to its first token, where it reports one: after that
    # token it packs the weights it ran from the file before timing anything (not a start cost).
    first = [merg_record(f"{out}/{name}.merg.start.{i}.out").get("first_token_s") for i in (1, 2)]
    if all(x is not None for x in first):
        start["merg"] = min(first)
    cell = lambda m: f"{m['peak_total_mib']:.0f} ({m['peak_anon_mib']:.0f} + {m['peak_file_mib']:.0f})"
    print(f"{name:<34} {os.path.getsize(f) / 2**20:6.0f} | {cell(mem['llama']):>30} {cell(mem['merg']):>30} {mem['merg']['peak_total_mib'] / mem['llama']['peak_total_mib']:6.2f} |"
          f" {start['llama']:13.2f} s {start['merg']:8.2f} s {start['merg'] / start['llama']:6.2f}")
print("peak = the most resident at once over the run, sampled every 20 ms (anonymous and file-backed peaks apiece);")
print("ratio = merg ÷ llama.cpp (below 1: merg holds less, starts sooner). start = process start to the first")
print("prompt token computed (load + one token, no warm-up; the faster of two runs, page cache warm): llama.cpp's")
print("whole run, merg's first_token_s (from process start; it packs F32/BF16 weights behind that token).")
PYEOF
