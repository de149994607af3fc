#!/usr/bin/env bash
# System libraries merg builds against, installed only when missing (Debian/Ubuntu apt-get):
#   - ffmpeg's libav* development files, found through pkg-config (video-rs → ffmpeg-sys-next);
#   - libclang for ffmpeg-sys-next's bindgen step. bindgen (clang-sys) loads libclang.so,
#     libclang-<ver>.so or a versioned libclang.so.<n> / libclang-<ver>.so.<n>. The C++ API library
#     libclang-cpp.so.<n>, present on a fresh Debian through llvm, is NOT what it loads;
#   - python3 with venv + ensurepip, for the server tests' pinned openai/ollama clients
#     (scripts/py-clients.sh; the clients themselves come from PyPI, not apt);
#   - util-linux's `script` (Debian: bsdutils, essential, so normally present), which gives
#     tests/progress.rs the terminal its progress bars draw on.
#
# Usage: install-deps.sh [--dry-run]
#   --dry-run (or MERG_DEPS_DRY_RUN=1) prints what would be installed and changes nothing.
#   MERG_LIBCLANG_DIRS  overrides the directories searched for libclang (space-separated globs);
#   PKG_CONFIG_LIBDIR   is honoured by pkg-config itself, so tests can point it at a fake tree;
#   MERG_PYTHON3        the python checked for venv support (default python3).
set -euo pipefail

dry_run=${MERG_DEPS_DRY_RUN:-0}
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    *) echo "install-deps.sh: unknown argument '$arg' (only --dry-run is accepted)" >&2; exit 2 ;;
  esac
done

# Where clang-sys looks on Linux (LIBCLANG_PATH first, then the distribution layouts).
default_dirs="${LIBCLANG_PATH:-} /usr/lib/llvm-*/lib /usr/local/lib /usr/local/lib64 /usr/lib /usr/lib64 /usr/lib/*-linux-gnu"
libclang_dirs=${MERG_LIBCLANG_DIRS:-$default_dirs}

have_libclang() {
  local dir f
  for dir in $libclang_dirs; do
    [ -d "$dir" ] || continue
    for f in "$dir"/libclang*.so*; do
      [ -e "$f" ] || continue
      # libclang.so, libclang.so.1, libclang-14.so, libclang-14.so.1 — never libclang-cpp.so.14.
      if [[ "$(basename "$f")" =~ ^libclang(-[0-9][0-9.]*)?\.so(\.[0-9.]+)?$ ]]; then
        return 0
      fi
    done
  done
  return 1
}

need=()
if command -v pkg-config >/dev/null 2>&1; then
  for lib in libavcodec libavformat libavutil libswscale libavdevice libavfilter libswresample; do
    pkg-config --exists "$lib" 2>/dev/null || need+=("${lib}-dev")
  done
else
  need+=(pkg-config libavcodec-dev libavformat-dev libavutil-dev libswscale-dev libavdevice-dev
         libavfilter-dev libswresample-dev)
fi
have_libclang || need+=(clang libclang-dev)
"${MERG_PYTHON3:-python3}" -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3 python3-venv)
command -v script >/dev/null 2>&1 || need+=(bsdutils)

if [ ${#need[@]} -eq 0 ]; then
  [ "$dry_run" = 1 ] && echo "nothing to install"
  exit 0
fi
if [ "$dry_run" = 1 ]; then
  echo "would install: ${need[*]}"
  exit 0
fi

manual() {
  echo "install-deps.sh: $1." >&2
  echo "  merg needs these system packages (Debian/Ubuntu names): ${need[*]}" >&2
  echo "  Install them (as root: apt-get install ${need[*]}), or their equivalents on your" >&2
  echo "  distribution (ffmpeg development files and libclang), then run this again." >&2
  exit 1
}
command -v apt-get >/dev/null 2>&1 || manual "apt-get was not found, so nothing can be installed automatically"
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || manual "not running as root and sudo was not found"
  SUDO=(sudo)
fi
echo "installing: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
