#!/usr/bin/env bash
# Pipeline on 4 ranks: pp=4 with 1F1B and 8 micro-batches trains, writes the
# trace and timeline picture of step 2, redraws it with `meshtrain timeline`,
# checkpoints (a file per rank), resumes, and samples from the checkpoint; bad
# pipeline settings fail before training with a message.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
common=(--model.preset=tiny --model.layers=4 --training.batch=8 --training.sample_tokens=0 --parallel.pp=4
        --parallel.pp_schedule=1f1b --parallel.microbatches=8 --run.out="$run")
"$meshtrain" run -n 4 train "${common[@]}" --training.steps=3 --run.trace_step=2 | tee "$run/first.log"
grep -q "pipeline pp(4) 1f1b with 8 micro-batches of 1, bubble 27%; stages: embed+blocks 0 | blocks 1 | blocks 2 | blocks 3+head" "$run/first.log"
grep -q "pipeline trace of step 2 in $run/trace.json" "$run/first.log"
grep -q "<svg" "$run/timeline.svg"
grep -c '"cat": "forward"' "$run/trace.json" | grep -qx 32   # 8 micro-batches x 4 ranks
"$meshtrain" timeline "$run/trace.json" -o "$run/redrawn.svg" | grep -q "4 ranks drawn to $run/redrawn.svg; bubble per rank:"
grep -q "rank 3" "$run/redrawn.svg"
ls "$run"/checkpoints/step-00000003/{rank-00000.bin,rank-00003.bin,metadata.json} > /dev/null
"$meshtrain" run -n 4 train "${common[@]}" --training.steps=4 | tee "$run/second.log"
grep -q "resumed from .*step-00000003 at step 3" "$run/second.log"
grep -q "^step     4/4 | loss" "$run/second.log"
sample=$("$meshtrain" generate --checkpoint "$run/checkpoints" --prompt "Licence " --tokens 16 --seed 3)
[[ "$sample" == "Licence "* ]]
expect_error() {  # message, then the train arguments
  local message=$1; shift
  if "$meshtrain" run -n 4 train --model.preset=tiny --model.layers=4 --run.out="$run/bad" "$@" > "$run/bad.log" 2>&1; then
    echo "should have failed: $*"; exit 1
  fi
  grep -qF "$message" "$run/bad.log" || { cat "$run/bad.log"; exit 1; }
}
expect_error "parallel.pp = 3: pp(3) * ep(1) * tp(1) = 3 does not divide the world size 4" --parallel.pp=3
expect_error "parallel.virtual_stages = 2: pp(4) * virtual_stages(2) = 8 stages > 4 layers" \
  --parallel.pp=4 --parallel.pp_schedule=interleaved --parallel.virtual_stages=2
expect_error "parallel.microbatches = 3: training.batch (16) must be divisible by microbatches" --parallel.pp=4 --parallel.microbatches=3
expect_error "parallel.pp_split = \"3,2\"" --parallel.pp=2 --parallel.pp_split=3,2
expect_error "parallel.zero_stage = 3: does not combine with pp(2) > 1" --parallel.pp=2 --parallel.zero_stage=3
"$meshtrain" timeline "$run/first.log" > "$run/timeline-bad.log" 2>&1 && { echo "a log is not a trace"; exit 1; }
grep -q "not JSON" "$run/timeline-bad.log"
echo "ok: pipeline trained, drew its timeline, resumed and sampled"
