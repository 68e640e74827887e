#!/usr/bin/env bash
# Installs meshtrain from BUILD_DIR into a fresh prefix, builds tests/package as
# an outside project with find_package(meshtrain), and runs it.
set -euo pipefail
build_dir=$1 torch_prefix=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
cmake -S "$here" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DTORCH_CUDA_ARCH_LIST=9.0 \
  -DCMAKE_PREFIX_PATH="$work/prefix;$torch_prefix" > "$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$work/build/consumer"
