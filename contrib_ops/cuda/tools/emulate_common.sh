# Sourced by emulate_prefill.sh and emulate_gemv.sh. `emu_rewrite SOURCE OUT` copies a CUDA source with its
# `K<<<grid, block, bytes, stream>>>(arguments);` launches rewritten to `EmuLaunch(K, grid, block, bytes, arguments);`
# and its `extern __shared__ __align__(N) T name[];` arrays to `T* const name = EmuDynamicShared<T>();` (host_emulation.h),
# and fails, naming the lines, where one is left.
emu_rewrite() {
  local source=$1 out=$2
  sed -E -e 's/([A-Za-z_][A-Za-z0-9_]*(<[^<>]*>)?)<<<(.*), stream>>>\((.*)\);/EmuLaunch(\1, \3, \4);/' \
    -e 's/extern __shared__ __align__\([0-9]+\) (\w+) (\w+)\[\];/\1* const \2 = EmuDynamicShared<\1>();/' \
    "$source" >"$out"
  if grep -q '<<<\|extern __shared__' "$out"; then
    echo "$(basename "$0"): a launch or a dynamic shared array of $source was not rewritten:" >&2
    grep -n '<<<\|extern __shared__' "$out" >&2
    exit 1
  fi
}
