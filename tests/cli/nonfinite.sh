#!/usr/bin/env bash
# A diverging run (learning rate 1e30: the loss is not finite from step 2)
# never applies a non-finite step (Note [Non-finite steps]): with the
# default on_nonfinite = "stop" it ends at once, non-zero, saying so once, on
# 1 rank and on 2 (ZeRO-3), its checkpoints finite; with "skip" it passes
# over max_nonfinite_skips steps, marked in metrics.jsonl, then stops.
set -euo pipefail
meshtrain=$1
python=$2
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
common=(--model.preset=tiny --model.layers=2 --training.batch=4 --training.micro_batch=2 --training.steps=8
        --training.sample_tokens=0 --training.warmup=0 --checkpoint.every=1 --checkpoint.keep=3)
expect_stop() {  # log, then the command
  local log=$1
  shift
  if "$@" > "$log" 2>&1; then
    echo "a diverging run exited 0:"; cat "$log"; exit 1
  fi
  [ "$(grep -c "error: step 2: the loss is .* it was not applied" "$log")" = 1 ] || { cat "$log"; exit 1; }
  if grep -q "MPI_ABORT\|mpirun detected\|mpiexec detected" "$log"; then cat "$log"; exit 1; fi
}
all_finite() {  # every tensor of the newest checkpoint, exported
  "$meshtrain" export hf "$1" --out "$run/exported" > /dev/null
  "$python" - "$run/exported" <<'PY'
import glob, sys, torch
from safetensors.torch import load_file
for f in glob.glob(sys.argv[1] + "/*.safetensors"):
    for name, t in load_file(f).items():
        assert torch.isfinite(t).all(), f"{name} is not finite"
PY
  rm -rf "$run/exported"
}

expect_stop "$run/one.log" "$meshtrain" train "${common[@]}" --training.lr=1e30 --run.out="$run/one"
[ "$(cat "$run/one/checkpoints/latest")" = step-00000001 ] || { ls "$run/one/checkpoints"; exit 1; }
all_finite "$run/one/checkpoints"

expect_stop "$run/two.log" "$meshtrain" run -n 2 train "${common[@]}" --training.lr=1e30 --parallel.zero_stage=3 \
  --run.out="$run/two"
all_finite "$run/two/checkpoints"

if "$meshtrain" train "${common[@]}" --training.lr=1e30 --training.on_nonfinite=skip \
  --training.max_nonfinite_skips=2 --run.out="$run/skip" > "$run/skip.log" 2>&1; then
  echo "skipping without end exited 0"; cat "$run/skip.log"; exit 1
fi
grep -q "error: step 4: the loss is .* (3 such steps in a row)" "$run/skip.log" || { cat "$run/skip.log"; exit 1; }
[ "$(grep -c '"skipped":"non-finite' "$run/skip/metrics.jsonl")" = 2 ] || { cat "$run/skip/metrics.jsonl"; exit 1; }
all_finite "$run/skip/checkpoints"

echo "ok: non-finite steps stop or are passed over, never applied or saved"
