#!/usr/bin/env bash
# Trains a model whose vocabulary (300) is larger than its byte tokenizer's
# (256), with a long context, then drives `meshtrain serve` with hostile
# requests, bodies, clients and connections: tests/serve/hostile_test.py.
set -euo pipefail
meshtrain=$1
python=$2
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
"$meshtrain" prepare "$(dirname "$0")/../data/shakespeare_excerpt.txt" --out "$run/data" > /dev/null
"$meshtrain" train --model.preset=tiny --model.layers=2 --model.context=2048 --model.vocab_size=300 \
  --data.train_file="$run/data/train.bin" --data.val_file="$run/data/val.bin" --training.steps=2 --training.batch=1 \
  --training.micro_batch=1 --training.eval_batches=1 --training.sample_tokens=0 --run.out="$run" > "$run/train.log"
"$python" "$(dirname "$0")/../serve/hostile_test.py" "$meshtrain" "$run/checkpoints"
