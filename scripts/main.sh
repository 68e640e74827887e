#!/usr/bin/env bash
# The main job: set up, build, and run the multi-rank communicator self-check
# and bandwidth table on 2 local ranks. Extra arguments go to `selfcheck`.
set -euo pipefail
root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root_dir/scripts/setup.sh"
"$root_dir/scripts/build.sh"
exec "$root_dir/build/bin/meshtrain" run -n "${MESHTRAIN_RANKS:-2}" selfcheck "$@"
