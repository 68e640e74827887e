#!/usr/bin/env bash
# 2-D on 4 ranks: ZeRO-3 over fsdp(2) x tensor parallel tp(2) with sequence
# parallel trains, checkpoints a file per rank (plus the gathered parameters),
# resumes, refuses another tp, and samples from the checkpoint.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
common=(--model.preset=tiny --model.layers=2 --training.batch=4 --training.micro_batch=2 --training.sample_tokens=0
        --parallel.tp=2 --parallel.sequence_parallel=true --parallel.zero_stage=3 --run.out="$run")
"$meshtrain" run -n 4 train "${common[@]}" --training.steps=3 | tee "$run/first.log"
grep -q "dp(1) x fsdp(2), 3 units, float32 compute, float32 reductions over 2 x tensor parallel tp(2) with sequence parallel" "$run/first.log"
ls "$run"/checkpoints/step-00000003/{shard-rank-0.pt,shard-rank-3.pt,model.pt} > /dev/null
"$meshtrain" run -n 4 train "${common[@]}" --training.steps=5 | tee "$run/second.log"
grep -q "resumed from .*step-00000003 at step 3" "$run/second.log"
grep -q "^step     5/5 | loss" "$run/second.log"
if "$meshtrain" run -n 4 train "${common[@]}" --training.steps=6 --parallel.tp=4 > "$run/third.log" 2>&1; then
  echo "resuming tp=2 files with tp=4 should fail"; exit 1
fi
grep -q "was saved with layout '.*tp=2,sp=1', this run is '.*tp=4,sp=1'" "$run/third.log"
sample=$("$meshtrain" generate --checkpoint "$run/checkpoints" --prompt "Licence " --tokens 16 --seed 3)
[[ "$sample" == "Licence "* ]]
echo "ok: 2-D tensor-parallel training resumed and sampled"
