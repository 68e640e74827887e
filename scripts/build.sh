#!/usr/bin/env bash
# Configures (once) and builds meshtrain against the torch wheel of the Python
# environment scripts/setup.sh made (.venv, a link to it), through ccache.
#   BUILD_DIR      (default: build)     BUILD_TYPE (default: Release)
#   BUILD_TARGETS  (default: everything; main.sh builds meshtrain_app only)
#   MESHTRAIN_CUDA (default: AUTO where an NVIDIA driver is loaded, else OFF: a
#                  build for the CPU only, whose processes start 0.13 s sooner;
#                  Note [A build for the CPU only])
# Extra arguments go to the CMake configure step.
set -euo pipefail
root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv_dir=$(readlink -f "${MESHTRAIN_VENV:-"$root_dir/.venv"}")
build_dir=${BUILD_DIR:-"$root_dir/build"}
build_type=${BUILD_TYPE:-Release}
if [ ! -x "$venv_dir/bin/python" ]; then
  printf 'build: no Python environment at %s; run scripts/setup.sh first\n' "$venv_dir" >&2
  exit 1
fi

torch_prefix=$("$venv_dir/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
fresh=()
if [ -f "$build_dir/CMakeCache.txt" ] &&
   ! grep -qxF "MESHTRAIN_PYTHON:FILEPATH=$venv_dir/bin/python" "$build_dir/CMakeCache.txt"; then
  fresh=(--fresh)  # another Python environment: every package found again
fi
cuda=${MESHTRAIN_CUDA:-}
if [ -z "$cuda" ]; then
  cuda=OFF
  if [ -e /proc/driver/nvidia/version ] || [ -e /dev/nvidiactl ]; then cuda=AUTO; fi
fi
cuda_changed=false
if [ -f "$build_dir/CMakeCache.txt" ] && ! grep -qx "MESHTRAIN_CUDA:STRING=$cuda" "$build_dir/CMakeCache.txt"; then
  cuda_changed=true
fi
if [ ! -f "$build_dir/CMakeCache.txt" ] || [ $# -gt 0 ] || [ ${#fresh[@]} -gt 0 ] || $cuda_changed; then
  mkdir -p "$build_dir"
  log="$build_dir/configure.log"
  cmake "${fresh[@]}" -S "$root_dir" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE="$build_type" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DMESHTRAIN_PYTHON="$venv_dir/bin/python" -DMESHTRAIN_CUDA="$cuda" "$@" > "$log" 2>&1 || { cat "$log"; exit 1; }
  grep -E '^-- meshtrain:' "$log" || true
fi
targets=()
for target in ${BUILD_TARGETS:-}; do targets+=(--target "$target"); done
cmake --build "$build_dir" --parallel "$(nproc)" "${targets[@]}"
