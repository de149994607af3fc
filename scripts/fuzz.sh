#!/usr/bin/env bash
# Fuzzes merg's parsers (tests/fuzz: cargo-fuzz + libFuzzer) for SECONDS per target, starting
# from the committed seed corpora in tests/fuzz/corpus/<target>. Needs the nightly toolchain;
# installs cargo-fuzz (from crates.io) into ~/.cache/merg/cargo-fuzz when missing.
# Prints one line per target: executions, coverage, corpus size. A crash, hang (10 s) or an
# input using over 2 GiB fails the run; the input is saved under $CARGO_TARGET_DIR/fuzz/.
#
# usage: scripts/fuzz.sh [SECONDS] [TARGET...]      (default: 60 seconds, every target)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
[ $# -gt 0 ] && shift
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(sed -n 's/^name = "\(.*\)"$/\1/p' tests/fuzz/Cargo.toml | grep -v '^merg-fuzz$')
fi
if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  echo "fuzz.sh: libFuzzer needs the nightly Rust toolchain (rustup toolchain install nightly)" >&2
  exit 1
fi
root="${MERG_CARGO_FUZZ_ROOT:-$HOME/.cache/merg/cargo-fuzz}"
if [ ! -x "$root/bin/cargo-fuzz" ]; then
  echo "installing cargo-fuzz into $root" >&2
  cargo install cargo-fuzz --locked --version 0.13.2 --root "$root" >&2
fi
export PATH="$root/bin:$PATH"
out="${CARGO_TARGET_DIR:-$PWD/target}/fuzz"
mkdir -p "$out"
# The instrumented build (nightly, sanitizer coverage) never shares merg's own target dir.
export CARGO_TARGET_DIR="${MERG_FUZZ_BUILD_DIR:-$out/build}"
cargo +nightly fuzz build --fuzz-dir tests/fuzz -O --debug-assertions >&2
status=0
for t in "${targets[@]}"; do
  work="$out/corpus/$t"; art="$out/artifacts/$t/"
  mkdir -p "$work" "$art"
  log="$out/$t.log"
  if cargo +nightly fuzz run --fuzz-dir tests/fuzz -O --debug-assertions "$t" "$work" "tests/fuzz/corpus/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 -max_len=65536 \
      -artifact_prefix="$art" -print_final_stats=1 >"$log" 2>&1; then
    result=ok
  else
    result="FAILED (see $log and $art)"; status=1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  corp=$(grep -o 'corp: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  echo "fuzz $t: ${secs}s, ${execs:-?} executions, coverage ${cov:-?} edges / ${ft:-?} features, corpus ${corp:-?}: $result"
done
exit $status
