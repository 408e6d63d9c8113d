#!/bin/sh
# Installs what tests/test_kernel_arm64.py needs on Debian/Ubuntu x86-64: an AArch64 cross compiler and
# qemu-user (to run the static AArch64 test program). Idempotent: does nothing when both are present.
# Elsewhere (arm64 hosts, macOS, other distributions) it says what to do and exits 0, so a Makefile's
# deps step can always call it.
set -eu

PACKAGES="g++-aarch64-linux-gnu qemu-user"

have_tools() {
  command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1
}

if have_tools; then
  exit 0
fi

machine=$(uname -m)
if [ "$(uname -s)" != "Linux" ] || { [ "$machine" != "x86_64" ] && [ "$machine" != "amd64" ]; }; then
  echo "install_cross_tools: $(uname -s)/$machine needs no cross toolchain (arm64 hosts build the AArch64 test natively)."
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_cross_tools: no apt-get here. Install an aarch64-linux-gnu g++ cross compiler and qemu-user" >&2
  echo "(qemu-aarch64) with your package manager; tests/test_kernel_arm64.py fails without them." >&2
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  echo "install_cross_tools: not root and no password-less sudo. Run:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y $PACKAGES" >&2
  echo "tests/test_kernel_arm64.py fails until they are installed." >&2
  exit 0
fi

echo "install_cross_tools: installing $PACKAGES"
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086  # $SUDO is empty or one command with an option
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $PACKAGES
have_tools
