#!/usr/bin/env bash
# Trains a tiny model, then drives `meshtrain serve` (one rank and tensor
# parallel over 2) with the openai client, curl and concurrent clients:
# tests/serve/serve_test.py.
set -euo pipefail
meshtrain=$1
python=$2
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
"$meshtrain" train --model.preset=tiny --model.layers=2 --training.steps=10 --training.batch=4 \
  --training.micro_batch=4 --training.sample_tokens=0 --run.out="$run" > "$run/train.log"
SERVE_TEST_TP=2 "$python" "$(dirname "$0")/../serve/serve_test.py" "$meshtrain" "$run/checkpoints"
