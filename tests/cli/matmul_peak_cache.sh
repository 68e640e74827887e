#!/usr/bin/env bash
# Note [Matmul peak]: a training process reads the matmul rate kept in
# $MESHTRAIN_CACHE/matmul-peak.json instead of measuring it (MFU quotes the kept
# rate); `bench train` measures afresh and keeps the best seen; an unreadable
# file is measured over.
set -euo pipefail
meshtrain=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export MESHTRAIN_CACHE="$dir/cache"
cache=$MESHTRAIN_CACHE/matmul-peak.json
common=(--model.preset=tiny --model.layers=1 --training.batch=2 --training.micro_batch=2)
bench() { "$meshtrain" bench train --steps 1 --warmup-steps 0 "${common[@]}" --run.out="$dir/bench" 2> /dev/null | grep '^{'; }
mfu() {  # MFU of a one-step training run, as its metrics row has it
  rm -rf "$dir/train"
  "$meshtrain" train "${common[@]}" --training.steps=1 --training.sample_tokens=0 --run.out="$dir/train" > /dev/null
  python3 -c 'import json, sys; print(json.loads(open(sys.argv[1]).readline())["mfu"])' "$dir/train/metrics.jsonl"
}
kept() { python3 -c 'import json, sys; kept = json.load(open(sys.argv[1])); assert len(kept) == 1, kept; print(list(kept.values())[0])' "$cache"; }
set_kept() { python3 -c 'import json, sys; json.dump({k: float(sys.argv[2]) for k in json.load(open(sys.argv[1]))}, open(sys.argv[1], "w"))' "$cache" "$1"; }
measured=$(bench | python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["matmul_peak_gflops_per_rank"] * 1e9)')
python3 -c 'import sys; assert abs(float(sys.argv[1]) / float(sys.argv[2]) - 1) < 1e-6' "$(kept)" "$measured"
set_kept 1e3  # a rate no CPU is as slow as: a run that reads it quotes an MFU in the thousands
python3 -c 'import sys; assert float(sys.argv[1]) > 1e3, sys.argv[1]' "$(mfu)" || { echo "train measured instead of reading the kept rate"; exit 1; }
bench > /dev/null  # measures afresh: the kept rate rises to it
python3 -c 'import sys; assert float(sys.argv[1]) > 1e6, sys.argv[1]' "$(kept)" || { echo "bench train did not raise the kept rate"; exit 1; }
echo "not json" > "$cache"
python3 -c 'import sys; assert 0 < float(sys.argv[1]) < 10, sys.argv[1]' "$(mfu)"
kept > /dev/null
echo "ok: training reads the kept matmul rate, bench train measures afresh and keeps the best, an unreadable file is measured over"
