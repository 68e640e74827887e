#!/usr/bin/env bash
# Tensor parallel from sharding annotations on 2 ranks: the same losses as
# the hand-written plan, a sharding report, a checkpoint the plan resumes
# from, and a sample from it.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
common=(--model.preset=tiny --model.layers=2 --training.batch=4 --training.micro_batch=2 --training.sample_tokens=0
        --parallel.tp=2)
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=3 --run.out="$run/plan" | tee "$run/plan.log"
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=3 --run.out="$run/annotated" \
  --parallel.tp_impl=annotations --run.sharding_report="$run/report.jsonl" | tee "$run/annotated.log"
grep -q "tensor parallel tp(2) from sharding annotations" "$run/annotated.log"
# The same losses, step by step (printed to 4 decimals).
diff <(grep -o "^step .* | loss [0-9.]*" "$run/plan.log") <(grep -o "^step .* | loss [0-9.]*" "$run/annotated.log")
# The report: operators with placements, and the sums before the norms.
grep -q '"op":"embedding"' "$run/report.jsonl"
grep -q '"collective":"all_reduce","for":"native_layer_norm"' "$run/report.jsonl"
grep -q "native_layer_norm .*all_reduce over tp" "$run/annotated.log"
# Its checkpoint holds the plan's pieces: the plan resumes from it.
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=5 --run.out="$run/annotated" | tee "$run/resumed.log"
grep -q "resumed from .*step-00000003 at step 3" "$run/resumed.log"
grep -q "^step     5/5 | loss" "$run/resumed.log"
sample=$("$meshtrain" generate --checkpoint "$run/annotated/checkpoints" --prompt "Licence " --tokens 16 --seed 3)
[[ "$sample" == "Licence "* ]]
echo "ok: annotations trained like the plan, reported, and the plan resumed from their checkpoint"
