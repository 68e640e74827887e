#!/usr/bin/env bash
# Set up, build, and run every test (unit, fault injection, package, and the
# multi-rank suites under mpirun with 1, 2, 3, 4 and 8 ranks).
set -euo pipefail
root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root_dir/scripts/setup.sh"
"$root_dir/scripts/build.sh"
cd "${BUILD_DIR:-"$root_dir/build"}"
exec ctest --output-on-failure --parallel "$(nproc)" "$@"
