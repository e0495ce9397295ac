#!/usr/bin/env bash
# Installs what fsdp-lua needs from Debian's packages. Idempotent and quiet
# when everything is present. Run as root (or with sudo available).
set -euo pipefail

packages=(
  build-essential cmake pkg-config        # the build
  luajit libluajit-5.1-dev                # the Lua side
  libopenblas-dev                         # f32 matmul
  libdnnl-dev                             # oneDNN: bf16 (and large f32) CPU matmuls
  libopenmpi-dev openmpi-bin              # multi-rank runs
  libreadline-dev                         # REPL line editing
  util-linux                              # `script` (the REPL pseudo-terminal test), `unshare`
  iproute2                                # ip, tc: tools/netcluster's namespaces and shaped links
  gnuplot-nox                             # tools/plot
  python3 python3-torch python3-numpy     # reference scripts and golden fixtures
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
