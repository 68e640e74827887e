#!/usr/bin/env bash
# A mixture-of-experts model trained on 2 ranks with expert parallel (ep = 2):
# the progress line and metrics carry the expert numbers, the checkpoint
# resumes with ep = 1 (experts gathered), and generate samples from it.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
moe=(--model.preset=tiny --model.moe_experts=4 --model.moe_top_k=2 --training.batch=8 --training.micro_batch=2
     --training.sample_tokens=0 --run.out="$run")
"$meshtrain" run -n 2 train "${moe[@]}" --parallel.ep=2 --training.steps=3 | tee "$run/train.log"
grep -q "expert parallel ep(2), 2 experts per rank" "$run/train.log"
grep -Eq "^step     3/3 \| loss [0-9.]+ \| val [0-9.]+ \| aux [0-9.]+ \| dropped [0-9.]+% \| load [0-9.]+" "$run/train.log"
grep -q '"moe":\[{"aux_loss"' "$run/metrics.jsonl"
"$meshtrain" checkpoint inspect "$run/checkpoints" > "$run/inspect.txt"
grep -Eq "model/blocks.1.moe.fc_weight +\[4, 1024, 256\]" "$run/inspect.txt"  # whole: the two ranks' experts
# The same run continues on 2 ranks as plain data parallel (ep = 1).
"$meshtrain" run -n 2 train "${moe[@]}" --training.steps=5 | tee "$run/resume.log"
grep -q "resumed from" "$run/resume.log"
grep -q "^step     5/5 | loss" "$run/resume.log"
sample=$("$meshtrain" generate --checkpoint "$run/checkpoints" --prompt "Licence " --tokens 16 --seed 3)
printf 'sample: %s\n' "$sample"
[[ "$sample" == "Licence "* ]]
echo "ok: an expert-parallel run resumed with ep = 1 and sampled"
