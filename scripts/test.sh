#!/usr/bin/env bash
# Set up (with the tests' Python packages), build, and run the tests: every
# test by default (what CI runs), or what the arguments select, which go to
# ctest (e.g. -L quick for the edit loop; docs/testing.md).
set -euo pipefail
root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root_dir/scripts/setup.sh" --tests
"$root_dir/scripts/build.sh"
cd "${BUILD_DIR:-"$root_dir/build"}"
exec ctest --output-on-failure --parallel "$(nproc)" "$@"
