#!/usr/bin/env bash
# The main job: set up what it needs, build the meshtrain executable, and train
# the `small` GPT on 2 local ranks with data parallel on the text under
# /usr/share/common-licenses; prints the loss falling and a generated sample at
# the end. Extra arguments go to `train` (e.g. --training.steps=20 or a config file).
set -euo pipefail
root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root_dir/scripts/setup.sh"
BUILD_TARGETS=meshtrain_app "$root_dir/scripts/build.sh"
cd "$root_dir"
exec "$root_dir/build/bin/meshtrain" run -n "${MESHTRAIN_RANKS:-2}" train --checkpoint.resume=false "$@"
