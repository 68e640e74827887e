#!/usr/bin/env bash
# meshtrain verify (Note [Verify]) on a Llama 3.2 1B preset scaled down with
# tensor parallel: demanding more than the floating-point sums of tensor
# parallel can give, it names the step, the first block whose output differs
# and the first whose parameters differ, and exits 1. (docs/planner.md's example, run by docs.run, is a layout verified
# the same as one process, exit 0.)
set -euo pipefail
meshtrain=$1
data=$2
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
status=0
"$meshtrain" run -n 2 verify --steps 2 --tolerance 1e-12 --scale-down --model.preset=llama3.2-1b \
  --model.vocab_size=256 --parallel.tp=2 --data.text="$data" --run.out="$run" > "$run/strict.log" || status=$?
cat "$run/strict.log"
[ "$status" = 1 ] || { echo "exit $status, not 1"; exit 1; }
grep -q "^meshtrain verify: tp=2 mb=1 on 2 rank(s) against one process, 2 step(s)" "$run/strict.log"
grep -q "(scaled down: layers 16 -> 2, width 2048 -> 512, context 131072 -> 64, batch 16 -> 1, micro-batch 8 -> 1)" \
  "$run/strict.log"
grep -q "^verdict: DIFFERENT from step 1: .*; the first block whose output differs in it: blocks\.[01] .*; the first block whose parameters differ after it: " "$run/strict.log"
[ ! -e "$run/verify" ]  # its runs are removed
echo "ok: verify"
