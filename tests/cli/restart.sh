#!/usr/bin/env bash
# meshtrain run --max-restarts (Note [Restarts]): a rank killed with SIGKILL
# mid-run is relaunched from the latest checkpoint and the run ends with the
# losses of an uninterrupted one; with --restart-on-hang a rank that hangs
# (SIGSTOP, the watchdog ends the job) too; an error every rank agreed on is
# not restarted; a "restart" line goes to metrics.jsonl.
set -euo pipefail
meshtrain=$1
python=$2
run=$(mktemp -d)
trap 'kill $(jobs -p) 2> /dev/null || true; pkill -KILL -f -- "--run.out=$run/" 2> /dev/null || true; rm -rf "$run"' EXIT
# A flat learning rate: runs of different lengths agree step for step.
common=(--model.preset=tiny --model.layers=2 --training.batch=4 --training.micro_batch=2 --training.sample_tokens=0
        --training.lr=1e-3 --training.min_lr=1e-3 --training.warmup=0 --training.eval_every=0 --training.steps=14
        --checkpoint.every=3 --checkpoint.async=false)
losses() { "$python" -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(" ".join(repr(r["loss"]) for r in rows if "loss" in r and r["step"] > 10))' "$1/metrics.jsonl"; }
wait_for_step() {  # folder, step
  for _ in $(seq 600); do
    grep -q "\"step\":$2," "$1/metrics.jsonl" 2> /dev/null && return 0
    sleep 0.1
  done
  echo "no step $2 in $1 within 60 s"; exit 1
}
"$meshtrain" run -n 2 train "${common[@]}" --run.out="$run/ref" > "$run/ref.log" 2>&1 || { cat "$run/ref.log"; exit 1; }

# A rank killed at step 5 or so: one restart, resumed from a checkpoint, the same losses at the end.
"$meshtrain" run -n 2 --max-restarts 2 train "${common[@]}" --run.out="$run/a" > "$run/a.log" 2>&1 &
launcher=$!
wait_for_step "$run/a" 5
kill -KILL "$(pgrep -f -- "train .*--run.out=$run/a" | grep -v "^$launcher\$" | tail -1)"
status=0
wait "$launcher" || status=$?
[ "$status" = 0 ] || { echo "status $status"; cat "$run/a.log"; exit 1; }
grep -q "meshtrain: restart 1 of 2 after: .*noticed that process rank [01] .* signal 9" "$run/a.log" || { cat "$run/a.log"; exit 1; }
grep -q "restart 1: resumed at step [369]" "$run/a.log" || { cat "$run/a.log"; exit 1; }
[ "$(grep -c "meshtrain: restart [0-9]* of" "$run/a.log")" = 1 ] || { cat "$run/a.log"; exit 1; }
grep -q '"attempt":1,"cause":".*signal 9.*","event":"restart","ranks":2' "$run/a/metrics.jsonl" || {
  cat "$run/a/metrics.jsonl"; exit 1; }
[ "$(losses "$run/a")" = "$(losses "$run/ref")" ] || {
  echo "after the restart: $(losses "$run/a")"; echo "uninterrupted: $(losses "$run/ref")"; exit 1; }

# A rank that hangs: the watchdog ends the job, --restart-on-hang relaunches it.
MESHTRAIN_COMM_TIMEOUT=5 "$meshtrain" run -n 2 --max-restarts 1 --restart-on-hang train "${common[@]}" \
  --run.out="$run/b" > "$run/b.log" 2>&1 &
launcher=$!
wait_for_step "$run/b" 4
stopped=$(pgrep -f -- "train .*--run.out=$run/b" | grep -v "^$launcher\$" | tail -1)
kill -STOP "$stopped"
status=0
wait "$launcher" || status=$?
[ "$status" = 0 ] || { echo "status $status"; cat "$run/b.log"; exit 1; }
grep -q "meshtrain: restart 1 of 1 after: rank [01]: watchdog: " "$run/b.log" || { cat "$run/b.log"; exit 1; }
[ "$(losses "$run/b")" = "$(losses "$run/ref")" ] || { echo "after the hang: $(losses "$run/b")"; exit 1; }

# An error every rank agrees on is not restarted; supervision is for train only.
status=0
"$meshtrain" run -n 2 --max-restarts 3 train "${common[@]}" --training.micro_batch=3 --run.out="$run/c" \
  > "$run/c.log" 2>&1 || status=$?
[ "$status" = 1 ] && grep -q "not restarting: the job failed with an error, not a lost rank" "$run/c.log" || {
  echo "status $status"; cat "$run/c.log"; exit 1; }
[ "$(grep -c "launching 2 ranks" "$run/c.log")" = 1 ] || { cat "$run/c.log"; exit 1; }
status=0
"$meshtrain" run -n 2 --max-restarts 1 selfcheck > "$run/d.log" 2>&1 || status=$?
[ "$status" != 0 ] && grep -q "supervise a command that resumes where it stopped (train), not \`selfcheck\`" "$run/d.log" || { cat "$run/d.log"; exit 1; }
echo "ok: a killed rank and a hung rank are restarted and the run ends as an uninterrupted one; errors are not"
