#!/usr/bin/env bash
# 2-D on 4 ranks: ZeRO-3 over fsdp(2) x tensor parallel tp(2) with sequence
# parallel trains, checkpoints, resumes, continues as tp(4), and samples
# from the checkpoint.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
common=(--model.preset=tiny --model.layers=2 --training.batch=4 --training.micro_batch=2 --training.sample_tokens=0
        --run.out="$run")
layout=(--parallel.tp=2 --parallel.sequence_parallel=true --parallel.zero_stage=3)
"$meshtrain" run -n 4 train "${common[@]}" "${layout[@]}" --training.steps=3 | tee "$run/first.log"
grep -q "dp(1) x fsdp(2), 3 units, float32 compute, float32 reductions x tensor parallel tp(2) with sequence parallel" "$run/first.log"
ls "$run"/checkpoints/step-00000003/{rank-00000.bin,rank-00003.bin,metadata.json} > /dev/null
"$meshtrain" run -n 4 train "${common[@]}" "${layout[@]}" --training.steps=5 | tee "$run/second.log"
grep -q "resumed from .*step-00000003 at step 3" "$run/second.log"
grep -q "^step     5/5 | loss" "$run/second.log"
"$meshtrain" run -n 4 train "${common[@]}" --training.micro_batch=4 --parallel.tp=4 --training.steps=6 | tee "$run/third.log"
grep -q "resumed from .*step-00000005 at step 5" "$run/third.log"
grep -q "^step     6/6 | loss" "$run/third.log"
# Tensor-parallel generation (heads, KV cache and vocabulary split) gives one
# rank's tokens: sampled with top-k and top-p, and greedy up to a stop string;
# so does the KV cache split over cp ranks.
for args in "--seed 3 --top-p 0.9" "--temperature 0 --stop ce"; do
  read -ra sampling <<< "$args"
  one=$("$meshtrain" generate --checkpoint "$run/checkpoints" --prompt "Licence " --tokens 40 "${sampling[@]}")
  [[ "$one" == "Licence "* ]]
  for tp in 2 4; do
    split=$("$meshtrain" run -n $tp generate --parallel.tp=$tp --checkpoint "$run/checkpoints" --prompt "Licence " \
      --tokens 40 "${sampling[@]}")
    [ "$split" = "$one" ] || { printf 'tp %s: %q\n  1: %q\n' "$tp" "$split" "$one"; exit 1; }
  done
  # The KV cache split over cp ranks (ring prefill, decode merged over the ranks): the same text.
  for cp in 2 3; do
    split=$("$meshtrain" run -n $cp generate --parallel.cp=$cp --checkpoint "$run/checkpoints" --prompt "Licence " \
      --tokens 40 "${sampling[@]}")
    [ "$split" = "$one" ] || { printf 'cp %s: %q\n  1: %q\n' "$cp" "$split" "$one"; exit 1; }
  done
done
if "$meshtrain" run -n 2 generate --parallel.cp=2 --parallel.tp=2 --checkpoint "$run/checkpoints" 2> "$run/both.err"; then
  echo "cp and tp together were accepted"; exit 1
fi
[ "$(grep -c "use one of them" "$run/both.err")" = 1 ]  # said once, by rank 0
echo "ok: 2-D tensor-parallel training resumed, continued as tp(4), and sampled alike on 1, 2 and 4 ranks (tp) and 2, 3 (cp)"
