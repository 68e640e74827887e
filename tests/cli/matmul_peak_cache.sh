#!/usr/bin/env bash
# Note [Matmul peak]: the first training process measures the matmul rate and
# keeps it in $MESHTRAIN_CACHE/matmul-peak.json; the next reads it instead of
# measuring (MFU then quotes the kept rate); an unreadable file is measured over.
set -euo pipefail
meshtrain=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export MESHTRAIN_CACHE="$dir/cache"
bench() {
  "$meshtrain" bench train --steps 1 --warmup-steps 0 --model.preset=tiny --model.layers=1 --training.batch=2 \
    --training.micro_batch=2 --run.out="$dir/run" 2> /dev/null | grep '^{'
}
peak() { python3 -c 'import json, sys; print(round(json.loads(sys.stdin.read())["matmul_peak_gflops_per_rank"]))'; }
first=$(bench | peak)
python3 - "$MESHTRAIN_CACHE/matmul-peak.json" "$first" <<'PY'
import json, sys
kept = json.load(open(sys.argv[1]))
assert len(kept) == 1 and abs(list(kept.values())[0] / 1e9 - float(sys.argv[2])) <= 1, kept
json.dump({key: 12345e9 for key in kept}, open(sys.argv[1], "w"))  # a rate no CPU here reaches
PY
[[ $(bench | peak) == 12345 ]] || { echo "the kept rate was not used"; exit 1; }
echo "not json" > "$MESHTRAIN_CACHE/matmul-peak.json"
again=$(bench | peak)
[[ $again -gt 0 && $again != 12345 ]] || { echo "an unreadable cache file was not measured over ($again)"; exit 1; }
python3 -c 'import json, sys; assert len(json.load(open(sys.argv[1]))) == 1' "$MESHTRAIN_CACHE/matmul-peak.json"
echo "ok: the matmul rate is measured once per machine, kept, and measured over when its file is unreadable"
