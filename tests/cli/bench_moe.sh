#!/usr/bin/env bash
# meshtrain bench moe as a person runs it, on a tiny model and 2 ranks (ep 2):
# the all-to-all bytes of one MoE layer equal the formula from its routing,
# and the training rows compare MoE with the dense model.
set -euo pipefail
meshtrain=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$meshtrain" run -n 2 bench moe --steps 1 --warmup-steps 0 --model.preset=tiny --model.layers=2 \
  --training.batch=8 --training.micro_batch=2 --run.out="$dir/run" | tee "$dir/bench.txt"
python3 - "$dir/bench.txt" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
layers = [r for r in rows if r["part"] == "layer"]
assert [r["top_k"] for r in layers] == [1, 2] and all(r["ep"] == 2 for r in layers), layers
for r in layers:
    assert r["bytes_per_step"] > 0 and r["bytes_per_step"] == r["bytes_formula"], r
training = {r["model"]: r for r in rows if r["part"] == "training"}
assert set(training) == {"dense", "moe top-1", "moe top-2"}, training
assert all(abs(r["active_parameters"] / training["dense"]["active_parameters"] - 1) < 0.01 for r in training.values())
PY
grep -q "vs dense" "$dir/bench.txt"
