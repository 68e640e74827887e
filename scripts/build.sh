#!/usr/bin/env bash
# Configures (once) and builds meshtrain against the torch wheel in .venv.
#   BUILD_DIR  (default: build)    BUILD_TYPE (default: Release)
# Extra arguments go to the CMake configure step.
set -euo pipefail
root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv_dir=${MESHTRAIN_VENV:-"$root_dir/.venv"}
build_dir=${BUILD_DIR:-"$root_dir/build"}
build_type=${BUILD_TYPE:-Release}

torch_prefix=$("$venv_dir/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
if [ ! -f "$build_dir/CMakeCache.txt" ] || [ $# -gt 0 ]; then
  mkdir -p "$build_dir"
  log="$build_dir/configure.log"
  cmake -S "$root_dir" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE="$build_type" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DMESHTRAIN_PYTHON="$venv_dir/bin/python" "$@" > "$log" 2>&1 || { cat "$log"; exit 1; }
  grep -E '^-- meshtrain:' "$log" || true
fi
cmake --build "$build_dir" --parallel "$(nproc)"
