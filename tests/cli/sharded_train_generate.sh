#!/usr/bin/env bash
# ZeRO-3 on 2 ranks: trains, writes memory metrics, checkpoints (one file per
# rank, metadata, no full copy), resumes, continues on 3 ranks as ZeRO-2 from
# the same checkpoint, inspects it, and samples from it.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
common=(--model.preset=tiny --training.batch=12 --training.micro_batch=2 --training.sample_tokens=0 --run.out="$run")
"$meshtrain" run -n 2 train "${common[@]}" --parallel.zero_stage=3 --training.steps=3 | tee "$run/first.log"
grep -q "ZeRO stage 3 over dp(1) x fsdp(2)" "$run/first.log"
grep -q '"model_states":\[' "$run/metrics.jsonl"
ls "$run"/checkpoints/step-00000003/{rank-00000.bin,rank-00001.bin,metadata.json,MANIFEST.json} > /dev/null
"$meshtrain" run -n 2 train "${common[@]}" --parallel.zero_stage=3 --training.steps=5 | tee "$run/second.log"
grep -q "resumed from .*step-00000003 at step 3" "$run/second.log"
grep -q "^step     5/5 | loss" "$run/second.log"
# Another layout and rank count continue from it.
"$meshtrain" run -n 3 train "${common[@]}" --parallel.zero_stage=2 --training.steps=6 | tee "$run/third.log"
grep -q "resumed from .*step-00000005 at step 5" "$run/third.log"
grep -q "^step     6/6 | loss" "$run/third.log"
"$meshtrain" checkpoint inspect "$run/checkpoints" | tee "$run/inspect.log"
grep -q "saved by 3 rank(s) with layout: pp=1 dp=1 fsdp=3 tp=1 zero=2" "$run/inspect.log"
grep -q "model/wte.weight  *\[256, 256\]  *float32" "$run/inspect.log"
sample=$("$meshtrain" generate --checkpoint "$run/checkpoints" --prompt "Licence " --tokens 16 --seed 3)
[[ "$sample" == "Licence "* ]]
# A config error is said once, not once per rank, and nothing is overwritten.
before=$(cat "$run/checkpoints/latest")
if "$meshtrain" run -n 3 train "${common[@]}" --training.batch=10 > "$run/bad.log" 2>&1; then
  echo "batch 10 on 3 ranks should fail"; exit 1
fi
[ "$(grep -c "error: training.batch = 10" "$run/bad.log")" = 1 ] || { cat "$run/bad.log"; exit 1; }
if grep -q "MPI_ABORT\|mpirun detected\|mpiexec detected" "$run/bad.log"; then cat "$run/bad.log"; exit 1; fi
[ "$(cat "$run/checkpoints/latest")" = "$before" ]
echo "ok: sharded training resumed in two layouts, was inspected and sampled"
