#!/usr/bin/env bash
# Preemption (Note [Preemption]): SIGTERM to `meshtrain run -n 2 train` makes
# both ranks finish their step, save a checkpoint, name SIGTERM and exit 0 (so does
# SIGTERM to its process group as the ranks start, or one written down before they
# could hear it: Note [Naming the stop signal]); the same
# command resumes from it and continues bit-exactly (every later step's loss
# equals an uninterrupted run's); SIGUSR1 (Slurm's --signal) to a single
# process does the same.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
trap 'kill $(jobs -p) 2> /dev/null || true; rm -rf "$run"' EXIT
# A flat learning rate: the schedule does not depend on training.steps, so runs of different lengths agree.
common=(--model.preset=tiny --model.layers=2 --training.batch=4 --training.micro_batch=2 --training.sample_tokens=0
        --training.lr=1e-3 --training.min_lr=1e-3 --training.warmup=0 --training.eval_every=0
        --checkpoint.every=1000)

# shellcheck source=steps.sh
source "$(dirname "$0")/steps.sh"
preempted_step() { grep '"event":"preempted"' "$1/metrics.jsonl" | sed -E 's/.*"step":([0-9]+).*/\1/'; }

# Two ranks under the launcher.
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=100000 --run.out="$run/a" > "$run/a.log" 2>&1 &
launcher=$!
wait_for_steps "$run/a" 3
kill -TERM "$launcher"
status=0
wait "$launcher" || status=$?
[ "$status" = 0 ] || { echo "exit status $status after SIGTERM"; cat "$run/a.log"; exit 1; }
n=$(preempted_step "$run/a")
grep -q "SIGTERM: stopped after step $n of 100000, checkpoint written" "$run/a.log" || { cat "$run/a.log"; exit 1; }
[ "$(cat "$run/a/checkpoints/latest")" = "$(printf 'step-%08d' "$n")" ]
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=$((n + 3)) --run.out="$run/a" > "$run/resumed.log" 2>&1
grep -q "resumed from .*step-$(printf '%08d' "$n") at step $n" "$run/resumed.log" || { cat "$run/resumed.log"; exit 1; }
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=$((n + 3)) --run.out="$run/ref" > "$run/ref.log" 2>&1
resumed=$(grep '"step":' "$run/a/metrics.jsonl" | grep -v event | tail -3 | sed -E 's/.*"loss":([^,]+),.*/\1/')
reference=$(grep '"step":' "$run/ref/metrics.jsonl" | grep -v event | tail -3 | sed -E 's/.*"loss":([^,]+),.*/\1/')
[ -n "$resumed" ] && [ "$resumed" = "$reference" ] || {
  echo "after the resume: $resumed"; echo "uninterrupted: $reference"; exit 1; }

# SIGTERM to the launcher's whole process group while the ranks start: exit 0, whenever it lands.
setsid "$meshtrain" run -n 2 train "${common[@]}" --training.steps=100000 --run.out="$run/early" > "$run/early.log" 2>&1 &
launcher=$!
for _ in $(seq 300); do grep -q "meshtrain: launching" "$run/early.log" 2> /dev/null && break; sleep 0.05; done
kill -TERM -- "-$launcher"
status=0
for _ in $(seq 1200); do kill -0 "$launcher" 2> /dev/null || break; sleep 0.1; done
kill -0 "$launcher" 2> /dev/null && { echo "SIGTERM to the group at start: still training after 120 s"; status=124; }
[ "$status" = 0 ] && wait "$launcher" || status=$?
[ "$status" = 0 ] && grep -q "stopped before the ranks\|SIGTERM: stopped after step" "$run/early.log" || {
  echo "SIGTERM to the group at start: status $status"; cat "$run/early.log"; exit 1; }

# A stop the launcher received before mpirun was started, which it could not pass on: found when the handlers are set.
echo SIGTERM > "$run/stop-name"
MESHTRAIN_STOP_SIGNAL_FILE="$run/stop-name" timeout 120 "$meshtrain" train "${common[@]}" --training.steps=100000 \
  --run.out="$run/written" > "$run/written.log" 2>&1 || { cat "$run/written.log"; exit 1; }
grep -q "SIGTERM: stopped after step 1 of 100000, checkpoint written" "$run/written.log" || { cat "$run/written.log"; exit 1; }

# One process, Slurm's way: SIGUSR1.
"$meshtrain" train "${common[@]}" --training.steps=100000 --run.out="$run/b" > "$run/b.log" 2>&1 &
trainer=$!
wait_for_steps "$run/b" 2
kill -USR1 "$trainer"
status=0
wait "$trainer" || status=$?
[ "$status" = 0 ] && grep -q "SIGUSR1: stopped after step" "$run/b.log" || { echo "status $status"; cat "$run/b.log"; exit 1; }
[ -n "$(preempted_step "$run/b")" ]

# A grace too short for any save: none is begun, and the run resumes from the checkpoint before.
"$meshtrain" train "${common[@]}" --training.steps=100000 --checkpoint.every=3 --checkpoint.async=false \
  --checkpoint.preempt_grace_s=0.001 --run.out="$run/c" > "$run/c.log" 2>&1 &
trainer=$!
wait_for_steps "$run/c" 4
kill -USR1 "$trainer"
status=0
wait "$trainer" || status=$?
[ "$status" = 0 ] || { echo "status $status"; cat "$run/c.log"; exit 1; }
n=$(preempted_step "$run/c")
kept=$(printf 'step-%08d' $((n / 3 * 3)))
[ "$(cat "$run/c/checkpoints/latest")" = "$kept" ] || { cat "$run/c.log"; ls "$run/c/checkpoints"; exit 1; }
if [ $((n % 3)) != 0 ]; then
  grep -q "SIGUSR1: stopped after step $n of 100000; a checkpoint takes about .* were left of checkpoint.preempt_grace_s = 0.001, so none was begun: the same command resumes from step $((n / 3 * 3))" "$run/c.log" || {
    cat "$run/c.log"; exit 1; }
fi
# Ctrl-C typed at a terminal (script(1) gives the launcher one): it reaches the launcher only, and the ranks save.
if script -qec true /dev/null > /dev/null 2>&1 < /dev/null; then
  mkfifo "$run/keys"
  script -qfec "'$meshtrain' run -n 2 train ${common[*]} --training.steps=100000 --run.out='$run/e'" /dev/null \
    < "$run/keys" > "$run/e.log" 2>&1 &
  terminal=$!
  exec 3> "$run/keys"
  wait_for_steps "$run/e" 3
  printf '\003' >&3
  status=0
  wait "$terminal" || status=$?
  exec 3>&-
  [ "$status" = 0 ] && grep -q "SIGINT: stopped after step" "$run/e.log" || {
    echo "Ctrl-C at a terminal: status $status"; cat "$run/e.log"; exit 1; }
else
  echo "no pseudo-terminal here (script(1) failed): the Ctrl-C case is not run"
fi
echo "ok: preempted at step $n on 2 ranks and resumed bit-exactly; SIGUSR1 saves a single process too; no save past the grace"
