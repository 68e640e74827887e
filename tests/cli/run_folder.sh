#!/usr/bin/env bash
# The run folder cannot be written by two runs, nor keep being written by
# ranks whose launcher died, and metrics.jsonl stays whole lines that say
# what a resume replaced: Note [Run lock], Note [Orphaned ranks], Note
# [Metrics lines].
set -euo pipefail
meshtrain=$1
python=$2
run=$(mktemp -d)
trap 'kill $(jobs -p) 2> /dev/null || true; pkill -KILL -f -- "--run.out=$run/" || true; rm -rf "$run"' EXIT
common=(--model.preset=tiny --model.layers=2 --training.batch=4 --training.micro_batch=2 --training.sample_tokens=0
        --training.eval_every=0)
# shellcheck source=steps.sh
source "$(dirname "$0")/steps.sh"

# A second run on a folder in use is refused, naming the holder; the first is untouched.
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=100000 --checkpoint.every=1000 --run.out="$run/a" \
  > "$run/a.log" 2>&1 &
launcher=$!
wait_for_steps "$run/a" 2
status=0
"$meshtrain" train "${common[@]}" --training.steps=3 --run.out="$run/a" > "$run/second.log" 2>&1 || status=$?
[ "$status" != 0 ] || { echo "a second run on a folder in use was accepted"; exit 1; }
grep -q "$run/a is in use by another run (pid [0-9]* on host" "$run/second.log" || { cat "$run/second.log"; exit 1; }
[ "$(grep -c 'error' "$run/second.log")" = 1 ] || { echo "said more than once:"; cat "$run/second.log"; exit 1; }
before=$(steps_logged "$run/a")
wait_for_steps "$run/a" $((before + 2))

# SIGKILL of the launcher: mpirun and the ranks stop by themselves, saving first.
ranks=$(pgrep -f -- "--run.out=$run/a" | grep -v "^$launcher\$" || true)
[ -n "$ranks" ] || { echo "no processes of the first run found"; exit 1; }
kill -KILL "$launcher"
wait "$launcher" 2> /dev/null || true
for _ in $(seq 300); do
  pgrep -f -- "--run.out=$run/a" > /dev/null || break
  sleep 0.1
done
if pgrep -af -- "--run.out=$run/a"; then echo "processes of a killed launcher still run after 30 s"; exit 1; fi
grep -q '"event":"preempted"' "$run/a/metrics.jsonl" || { echo "no save when the launcher died"; cat "$run/a.log"; exit 1; }
n=$(grep '"event":"preempted"' "$run/a/metrics.jsonl" | sed -E 's/.*"step":([0-9]+).*/\1/')

# The folder is free again; a torn last line (a process killed mid-write) is cut, and the resume says so.
printf '{"step":99999,"lo' >> "$run/a/metrics.jsonl"
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=$((n + 2)) --checkpoint.every=1000 --run.out="$run/a" \
  > "$run/resumed.log" 2>&1 || { cat "$run/resumed.log"; exit 1; }
grep -q "metrics.jsonl ended in a torn line (17 bytes" "$run/resumed.log" || { cat "$run/resumed.log"; exit 1; }
"$python" - "$run/a/metrics.jsonl" "$n" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]  # every line is whole JSON
n = int(sys.argv[2])
resumed = [i for i, r in enumerate(rows) if r.get("event") == "resumed"]
assert len(resumed) == 1, rows
i = resumed[0]
assert rows[i]["step"] == n and rows[i]["superseded_rows"] == 0, rows[i]
assert [r["step"] for r in rows[i + 1:] if "loss" in r] == [n + 1, n + 2], rows[i + 1:]
PY

# Rows past the checkpoint a resume starts from are counted as superseded.
"$meshtrain" train "${common[@]}" --training.steps=6 --checkpoint.every=3 --checkpoint.async=false \
  --run.out="$run/b" > /dev/null
rm -rf "$run/b/checkpoints/step-00000006"
echo step-00000003 > "$run/b/checkpoints/latest"
"$meshtrain" train "${common[@]}" --training.steps=6 --checkpoint.every=3 --run.out="$run/b" > "$run/b.log" 2>&1
grep -q "3 rows after step 3 are from the run before this resume" "$run/b.log" || { cat "$run/b.log"; exit 1; }
grep -q '"event":"resumed","step":3,"superseded_rows":3' "$run/b/metrics.jsonl" || { cat "$run/b/metrics.jsonl"; exit 1; }
# The finished run again: it says so, trains nothing, and leaves its metrics and checkpoints as they are.
cp "$run/b/metrics.jsonl" "$run/b-metrics.before"
ls -R "$run/b/checkpoints" > "$run/b-checkpoints.before"
"$meshtrain" train "${common[@]}" --training.steps=6 --checkpoint.every=3 --run.out="$run/b" > "$run/again.log" 2>&1 ||
  { cat "$run/again.log"; exit 1; }
grep -q "the run is already complete: .*step-00000006 is at step 6 of 6; nothing to train" "$run/again.log" ||
  { cat "$run/again.log"; exit 1; }
cmp -s "$run/b/metrics.jsonl" "$run/b-metrics.before" || { echo "a finished run's metrics changed"; exit 1; }
ls -R "$run/b/checkpoints" | cmp -s - "$run/b-checkpoints.before" || { echo "a finished run's checkpoints changed"; exit 1; }
# Another model in that folder: refused, naming the keys that differ and how to start afresh; nothing written.
status=0
"$meshtrain" train "${common[@]}" --model.layers=1 --model.width=128 --training.steps=8 --run.out="$run/b" > "$run/other.log" 2>&1 ||
  status=$?
[ "$status" = 1 ] && grep -q "holds a different model (model.layers = 1 here, 2 there, model.width = 128 here, 256 there); .*checkpoint.resume = false to start afresh" \
  "$run/other.log" || { echo "status $status"; cat "$run/other.log"; exit 1; }
cmp -s "$run/b/metrics.jsonl" "$run/b-metrics.before" || { echo "a refused run changed the metrics"; exit 1; }
echo "ok: a second run is refused by name, a killed launcher's ranks save and stop, metrics lines stay whole, a finished run says so, another model is refused by its keys"
