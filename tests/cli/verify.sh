#!/usr/bin/env bash
# meshtrain verify (Note [Verify]): demanding more than the floating-point sums
# of tensor parallel can give names the step and the first block that differ,
# with exit 1; --scale-down verifies a preset's pipeline at a tiny size, equal
# to one process (and docs/planner.md's example, run by docs.run, a config's).
set -euo pipefail
meshtrain=$1
data=$2
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
common=(--model.preset=tiny --model.layers=2 --model.width=64 --model.context=32 --training.batch=4
        --training.micro_batch=2 --data.text="$data" --run.out="$run")
status=0
"$meshtrain" run -n 2 verify --steps 2 --tolerance 1e-12 "${common[@]}" --parallel.tp=2 > "$run/strict.log" \
  || status=$?
[ "$status" = 1 ] || { cat "$run/strict.log"; echo "exit $status, not 1"; exit 1; }
grep -q "^verdict: DIFFERENT from step 1: .*; the first block whose parameters differ after it: " "$run/strict.log" \
  || { cat "$run/strict.log"; exit 1; }
"$meshtrain" run -n 2 verify --steps 2 --scale-down --model.preset=llama3.2-1b --model.vocab_size=256 --parallel.pp=2 \
  --data.text="$data" --run.out="$run" | tee "$run/scaled.log"
grep -q "(scaled down: layers 16 -> 2, width 2048 -> 512, context 131072 -> 64, batch 16 -> 2, micro-batch 8 -> 1)" \
  "$run/scaled.log"
grep -q "^meshtrain verify: pp=2 1f1b mb=1 on 2 rank(s) against one process, 2 step(s)" "$run/scaled.log"
grep -q "^verdict: the same computation" "$run/scaled.log"
[ ! -e "$run/verify" ]  # its runs are removed
echo "ok: verify"
