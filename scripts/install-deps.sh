#!/usr/bin/env bash
# System libraries merg builds against: ffmpeg (video-rs → ffmpeg-next) and clang for its
# bindgen step. Installs only what is missing; needs root or sudo for apt-get.
set -euo pipefail
need=()
for lib in libavcodec libavformat libavutil libswscale libavdevice libavfilter libswresample; do
  pkg-config --exists "$lib" 2>/dev/null || need+=("${lib}-dev")
done
command -v pkg-config >/dev/null || need+=(pkg-config)
[ -n "$(ls /usr/lib/llvm-*/lib/libclang*.so* 2>/dev/null)" ] || need+=(clang libclang-dev)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
echo "installing: ${need[*]}" >&2
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
