#!/usr/bin/env bash
# Installs meshtrain from BUILD_DIR into a fresh prefix, builds PROJECT (a
# directory with a CMakeLists.txt using find_package(meshtrain)) as an outside
# project, and runs its executable TARGET with the remaining arguments put in
# front (e.g. an mpirun command line; none: run it plainly).
#   check.sh BUILD_DIR TORCH_PREFIX PROJECT TARGET [LAUNCHER...]
set -euo pipefail
build_dir=$1 torch_prefix=$2 project=$3 target=$4
shift 4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
cmake -S "$project" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DTORCH_CUDA_ARCH_LIST=9.0 \
  -DCMAKE_PREFIX_PATH="$work/prefix;$torch_prefix" > "$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$@" "$work/build/$target"
