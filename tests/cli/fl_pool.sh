#!/usr/bin/env bash
# A thousand federated clients in one process (Note [A pool of clients]):
# `fl simulate --pool 2` over an iid split into 1,000 clients, rounds that
# sample 100 of them (over-selected), and an async run; every round completes
# with its target, the process keeps 2 trainers and a thread per client, and
# the clients' data is read only while they train.
set -euo pipefail
meshtrain=$1
here=$(cd "$(dirname "$0")" && pwd)
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
export OMP_NUM_THREADS=1
config=$here/../../examples/fl/shakespeare.toml

# The excerpt six times over: enough speeches for 1,000 clients to hold out validation text.
for _ in 1 2 3 4 5 6; do cat "$here/../data/shakespeare_excerpt.txt"; echo; done > "$run/play.txt"
# 1,050 clients, those with fewer than 24 bytes (2 sequences of 8) left out; the simulation takes the largest 1,000.
"$meshtrain" fl split "$run/play.txt" --out "$run/clients" --by iid --clients 1050 --min-bytes 24 > "$run/split.log"
[ "$(ls -d "$run"/clients/client*/ | wc -l)" -ge 1000 ] || fail "iid split: fewer than 1000 clients: $(cat "$run/split.log")"
common=(--fl.data.clients_dir="$run/clients" --fl.data.val_file="$run/clients/val.bin" --model.layers=1
  --model.width=32 --model.heads=2 --model.context=8 --fl.client.local_steps=1 --fl.client.batch=2
  --fl.min_available=1000 --fl.wait_clients_s=60 --fl.server.insecure=true --fl.server.listen=127.0.0.1:0 --fl.data.eval_batches=1)

start=$(date +%s)
"$meshtrain" fl simulate --clients 1000 --pool 2 "$config" "${common[@]}" --fl.rounds=2 --fl.clients_per_round=100 \
  --fl.over_select=0.1 --fl.server.out="$run/sync" > "$run/sync.log" 2>&1 || { tail -20 "$run/sync.log"; fail "sync pool"; }
grep -q "1000 clients as threads of this process, sharing 2 trainers" "$run/sync.log" || fail "no pool line"
python3 - "$run/sync/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
assert len(rows) == 2, rows
for r in rows:
    assert r["status"] == "ok", r
    assert len(r["sampled"]) == 110 and len(r["participants"]) == 100, (len(r["sampled"]), len(r["participants"]))
PY
echo "sync: 2 rounds of 100 of 1,000 pooled clients in $(( $(date +%s) - start )) s"

start=$(date +%s)
"$meshtrain" fl simulate --clients 1000 --pool 2 "$config" "${common[@]}" --fl.rounds=3 --fl.mode=async --fl.async.buffer=50 \
  --fl.async.concurrency=100 --fl.server.out="$run/async" > "$run/async.log" 2>&1 || { tail -20 "$run/async.log"; fail "async pool"; }
python3 - "$run/async/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
assert len(rows) == 3 and all(r["status"] == "ok" and len(r["participants"]) == 50 for r in rows), rows
PY
echo "async: 3 versions of 50 results from 1,000 pooled clients in $(( $(date +%s) - start )) s"
[ "$(grep -c "fl client" "$run/sync.log" || true)" -lt 10 ] || fail "pooled clients should be quiet"
"$meshtrain" fl simulate --clients 300 "$config" "${common[@]}" --fl.server.out="$run/none" > "$run/too_many.log" 2>&1 && fail "300 processes accepted"
grep -q "is more than 250 client processes: add --pool 2" "$run/too_many.log" || fail "$(cat "$run/too_many.log")"
echo ok
