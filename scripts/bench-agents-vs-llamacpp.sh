#!/usr/bin/env bash
# The five-agent workload on merg and on llama-server (the engine under the paper's Ollama) on
# the SAME GGUF file and projector: prompt tokens computed, cache share, dialogues per minute.
# The requests are the same on both sides (merg's `bench-agents` builds them and, with
# --server, sends them to llama-server's OpenAI API): system text, keyframes, dialogue, agent
# instruction and the upstream agents' outputs, greedy, a fixed number of new tokens.
# A user's benchmark, not a test. See --help.
set -Eeuo pipefail

usage() {
  cat <<'EOF'
usage: scripts/bench-agents-vs-llamacpp.sh [--level native|avx2] [--gguf FILE...]
                                           [--dialogues "4 8"] [--new-tokens N] [--keyframes K]
                                           [-t THREADS] [--out DIR]

For each GGUF file and dialogue count: `merg bench-agents --model FILE` (continuous batching,
prefix cache on), then llama-server (one server per configuration, prompt cache on) driven
with the same requests in stage order and in dialogue order, with 1 and with 4 slots.

  --level native|avx2  llama.cpp's build and merg's kernels, as in bench-vs-llamacpp.sh
  --gguf FILE...       text-model files with their mmproj-*.gguf beside them; default: the
                       random-weight Qwen2.5-VL 3B-width 8-layer file at F32 and Q4_K_M
  --dialogues "A B"    dialogue counts (default "4 8"); each dialogue is 8 agent calls
  --new-tokens N       tokens each call generates (default 16)
  --keyframes K        448x448 keyframes per dialogue (default 4)
  -t THREADS           threads for both (default: nproc)
  --out DIR            raw JSON and server logs (default target/bench-agents-vs-llamacpp/<time>)

Caches as bench-vs-llamacpp.sh (MERG_CACHE, default ~/.cache/merg).
EOF
}

die() { echo "bench-agents-vs-llamacpp: $*" >&2; exit 1; }
trap 'echo "bench-agents-vs-llamacpp: failed (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${MERG_CACHE:-$HOME/.cache/merg}
LEVEL=native THREADS=$(nproc) OUT="" GGUFS=() DIALOGUES="4 8" NEW=16 FRAMES=4 PORT=${PORT:-18080}
while (($#)); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --level) LEVEL=${2:?--level needs native or avx2}; shift 2 ;;
    --gguf) shift; while (($#)) && [[ $1 != -* ]]; do GGUFS+=("$(realpath "$1")"); shift; done
            ((${#GGUFS[@]})) || die "--gguf needs at least one file" ;;
    --dialogues) DIALOGUES=${2:?}; shift 2 ;;
    --new-tokens) NEW=${2:?}; shift 2 ;;
    --keyframes) FRAMES=${2:?}; shift 2 ;;
    -t) THREADS=${2:?}; shift 2 ;;
    --out) OUT=${2:?}; shift 2 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
[[ $LEVEL == native || $LEVEL == avx2 ]] || die "--level must be native or avx2"
for f in "${GGUFS[@]}"; do [[ -f $f ]] || die "no such file: $f"; done

# shellcheck source=scripts/llamacpp-setup.sh
source "$ROOT/scripts/llamacpp-setup.sh"
((${#GGUFS[@]})) || bench_ggufs "qwen2.5-vl-3b-text-8l:f32 q4_k_m"

echo "== cargo build --release"
(cd "$ROOT" && cargo build --release -q) || die "cargo build --release failed"
MERG=${CARGO_TARGET_DIR:-$ROOT/target}/release/merg
OUT=${OUT:-$ROOT/target/bench-agents-vs-llamacpp/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
KERNELS=()
[[ $LEVEL == avx2 ]] && KERNELS=(env MERG_CPU_KERNELS=avx2)
SERVER_PID=""
stop_server() { [[ -n $SERVER_PID ]] && kill "$SERVER_PID" 2> /dev/null && wait "$SERVER_PID" 2> /dev/null; SERVER_PID=""; }
trap stop_server EXIT

# start_server FILE MMPROJ SLOTS LOG: llama-server on 127.0.0.1:$PORT, 4096 tokens per slot.
start_server() {
  "$LDIR/bin/llama-server" -m "$1" --mmproj "$2" -t "$THREADS" -np "$3" -c $((4096 * $3)) \
    --host 127.0.0.1 --port "$PORT" > "$4" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 600); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2> /dev/null && return 0
    kill -0 "$SERVER_PID" 2> /dev/null || die "llama-server exited: see $4"
    sleep 0.5
  done
  die "llama-server did not become healthy in 300 s: see $4"
}

echo "== CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-), $THREADS threads, level $LEVEL; llama.cpp $LLAMA_LEVEL"
for f in "${GGUFS[@]}"; do
  mmproj=$(ls "$(dirname "$f")"/mmproj-*.gguf 2> /dev/null | head -1)
  [[ -n $mmproj ]] || die "no mmproj-*.gguf beside $f"
  name=$(basename "$f" .gguf)
  for D in $DIALOGUES; do
    WORK=(--dialogues "$D" --new-tokens "$NEW" --keyframes "$FRAMES")
    echo "== $name, $D dialogues: merg"
    "${KERNELS[@]}" "$MERG" bench-agents --model "$f" --mmproj "$mmproj" "${WORK[@]}" --repeats 0 > "$OUT/$name-$D-merg.json" \
      || die "merg bench-agents failed on $f"
    for slots in 1 4; do
      for order in stage dialogue; do
        echo "== $name, $D dialogues: llama-server, $slots slot(s), $order order"
        start_server "$f" "$mmproj" "$slots" "$OUT/$name-$D-server-$slots-$order.log"
        "$MERG" bench-agents --server "http://127.0.0.1:$PORT" --order "$order" --slots "$slots" "${WORK[@]}" \
          > "$OUT/$name-$D-llama-$slots-$order.json" || die "the llama-server run failed"
        stop_server
      done
    done
  done
done

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
print(f"\n{'file':38} {'dlg':>3} {'engine':32} {'computed':>9} {'of prompt':>9} {'cached':>7} {'dlg/min':>8} {'wall s':>7}")
for path in sorted(glob.glob(os.path.join(out, "*-merg.json"))):
    stem = os.path.basename(path)[: -len("-merg.json")]
    name, d = stem.rsplit("-", 1)
    r = json.load(open(path))
    on = r["with_cache"]
    p = on["stats"]["prefix"]
    rows = [("merg, continuous batching", p["computed_tokens"], p["prompt_tokens"], on["wall_s"])]
    for f in sorted(glob.glob(os.path.join(out, f"{stem}-llama-*.json"))):
        s = json.load(open(f))
        rows.append((f"llama-server, {s['slots']} slot(s), {s['order']}", s["computed_tokens"], s["computed_tokens"] + s["cached_tokens"], s["wall_s"]))
    for label, computed, prompt, wall in rows:
        print(f"{name:38} {d:>3} {label:32} {computed:9d} {prompt:9d} {1 - computed / max(prompt, 1):7.1%} {int(d) * 60 / wall:8.2f} {wall:7.1f}")
    best = max(rows[1:], key=lambda r: int(d) * 60 / r[3], default=None)
    fewest = min((r[1] for r in rows[1:]), default=None)
    if best:
        print(f"{'':38} {'':>3} merg ÷ best llama-server: {(rows[0][3] and best[3] / rows[0][3]):.2f}x dialogues/min; "
              f"computed tokens {rows[0][1]} vs fewest {fewest}")
PY
echo "raw JSON and server logs: $OUT"
