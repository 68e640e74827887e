#!/usr/bin/env bash
# ZeRO-3 on 2 ranks: trains, writes memory metrics, checkpoints its shards
# (plus the full parameters), resumes, and samples from the checkpoint.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
common=(--model.preset=tiny --training.batch=4 --training.micro_batch=2 --training.sample_tokens=0
        --parallel.zero_stage=3 --run.out="$run")
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=3 | tee "$run/first.log"
grep -q "ZeRO stage 3, dp(1) x fsdp(2)" "$run/first.log"
grep -q '"model_states":\[' "$run/metrics.jsonl"
ls "$run"/checkpoints/step-00000003/{shard-rank-0.pt,shard-rank-1.pt,model.pt} > /dev/null
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=5 | tee "$run/second.log"
grep -q "resumed from .*step-00000003 at step 3" "$run/second.log"
grep -q "^step     5/5 | loss" "$run/second.log"
# Another layout is refused, naming both.
if "$meshtrain" run -n 2 train "${common[@]}" --training.steps=6 --parallel.zero_stage=2 > "$run/third.log" 2>&1; then
  echo "resuming ZeRO-3 shards as ZeRO-2 should fail"; exit 1
fi
grep -q "was saved with layout 'zero_stage=3" "$run/third.log"
sample=$("$meshtrain" generate --checkpoint "$run/checkpoints" --prompt "Licence " --tokens 16 --seed 3)
[[ "$sample" == "Licence "* ]]
echo "ok: sharded training resumed and sampled"
