#!/usr/bin/env bash
# Trains a tiny model for a few steps on 2 ranks, then samples from its checkpoint.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
"$meshtrain" run -n 2 train --model.preset=tiny --training.steps=4 --training.batch=4 --training.micro_batch=2 \
  --training.eval_every=2 --training.sample_tokens=20 --run.out="$run" | tee "$run/train.log"
grep -q "^step     4/4 | loss" "$run/train.log"
grep -q "meshtrain: sample after 4 steps" "$run/train.log"
test "$(wc -l < "$run/metrics.jsonl")" -eq 4
grep -q '"val_loss"' "$run/metrics.jsonl"
test -f "$run/checkpoints/latest"
sample=$("$meshtrain" generate --checkpoint "$run/checkpoints" --prompt "Licence " --tokens 16 --seed 3)
again=$("$meshtrain" generate --checkpoint "$run/checkpoints" --prompt "Licence " --tokens 16 --seed 3)
printf 'sample: %s\n' "$sample"
[[ "$sample" == "Licence "* ]]
[ "$sample" = "$again" ]  # deterministic for a seed
# A stop string ends the text before it (the first 'e' after the prompt).
stopped=$("$meshtrain" generate --checkpoint "$run/checkpoints" --prompt "Licence " --tokens 64 --seed 3 --stop e)
[[ "$stopped" == "Licence "* ]]
[[ "${stopped#Licence }" != *e* ]]
echo "ok: trained, checkpointed and sampled"
