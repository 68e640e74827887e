#!/usr/bin/env bash
# Installs meshtrain from BUILD_DIR into a fresh prefix, builds PROJECT (a
# directory with a CMakeLists.txt using find_package(meshtrain)) as an outside
# project, and runs its executable TARGET with the remaining arguments put in
# front (e.g. an mpirun command line; none: run it plainly).
#   check.sh BUILD_DIR TORCH_PREFIX PROJECT TARGET [LAUNCHER...]
#
# The install and the build go to BUILD_DIR/package-check/TARGET, a path that is
# the same in every clone, so that the compiler cache (when installed) hits there
# as it does for meshtrain's own build (Note [Compile units]).
set -euo pipefail
build_dir=$(cd "$1" && pwd) torch_prefix=$2 project=$3 target=$4
shift 4
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work="$build_dir/package-check/$target"
rm -rf "$work"
mkdir -p "$work"
launcher=()
if command -v ccache > /dev/null; then launcher=("-DCMAKE_CXX_COMPILER_LAUNCHER=env;CCACHE_BASEDIR=$root;ccache"); fi
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
cmake -S "$project" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DTORCH_CUDA_ARCH_LIST=9.0 "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$work/prefix;$torch_prefix" > "$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$@" "$work/build/$target"
