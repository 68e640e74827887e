#!/usr/bin/env bash
# Tiered memory from the command line: ZeRO-Infinity training on 2 ranks (the
# optimizer and parameter shards in an NVMe folder) with the resident run's
# losses, and ZeRO-Inference (generate, serve) streaming the weights from host
# memory or NVMe under a device memory limit a quarter of the model's size,
# with the resident text. Bad settings are named.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
server=""
trap '[ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$run"' EXIT
common=(--model.preset=tiny --model.layers=12 --training.batch=8 --training.micro_batch=4 --training.steps=4
        --training.sample_tokens=0 --training.eval_every=0 --checkpoint.every=0 --parallel.zero_stage=3)
"$meshtrain" run -n 2 train "${common[@]}" --run.out="$run/resident" > "$run/resident.log"
"$meshtrain" run -n 2 train "${common[@]}" --offload.optimizer=nvme --offload.params=nvme \
  --offload.nvme_dir="$run/nvme" --run.out="$run/offloaded" > "$run/offloaded.log"
grep -q "optimizer offloaded to nvme, parameters to nvme" "$run/offloaded.log" || { cat "$run/offloaded.log"; exit 1; }
[ -z "$(ls -A "$run/nvme")" ] || { echo "the NVMe tier's files outlived the run"; ls -l "$run/nvme"; exit 1; }
python3 - "$run/resident/metrics.jsonl" "$run/offloaded/metrics.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(f) if '"loss"' in l] for f in sys.argv[1:])
assert len(a) == len(b) == 4, (a, b)
for s, (x, y) in enumerate(zip(a, b)):
    assert abs(x - y) <= 1e-5 * x, f"step {s + 1}: offloaded loss {y} vs resident {x}"
print("losses equal:", b)
PY

# The model is ~36 MiB (12 blocks of ~3 MiB); the device may hold 8 MiB.
ckpt="$run/resident/checkpoints"
gen=(generate --checkpoint "$ckpt" --prompt "The " --tokens 24 --temperature 0.8 --seed 3)
want=$("$meshtrain" "${gen[@]}")
if "$meshtrain" "${gen[@]}" --memory.limit_mb 8 > "$run/oom.log" 2>&1; then
  echo "the resident model should not fit 8 MiB"; exit 1
fi
grep -q "out of memory on rank 0" "$run/oom.log"
for weights in cpu nvme; do
  got=$("$meshtrain" "${gen[@]}" --offload.weights "$weights" --offload.nvme_dir "$run/nvme" --offload.kv cpu \
        --memory.limit_mb 8 --timing 2> "$run/gen-$weights.log") || { cat "$run/gen-$weights.log"; exit 1; }
  [ "$got" = "$want" ] || { echo "weights from $weights: '$got' vs '$want'"; cat "$run/gen-$weights.log"; exit 1; }
  grep -q "weights streamed from $weights" "$run/gen-$weights.log"
done

# Tensor parallel over 2 ranks, each streaming its half of every block from NVMe.
got=$("$meshtrain" run -n 2 "${gen[@]}" --parallel.tp=2 --offload.weights nvme --offload.nvme_dir "$run/nvme" \
      --memory.limit_mb 8 2> "$run/gen-tp.log") || { cat "$run/gen-tp.log"; exit 1; }
[ "$got" = "$want" ] || { echo "tp 2 from nvme: '$got' vs '$want'"; exit 1; }

"$meshtrain" serve --checkpoint "$ckpt" --port 0 --offload.weights cpu --offload.kv cpu --memory.limit_mb 8 \
  > "$run/serve.log" 2>&1 &
server=$!
for _ in $(seq 100); do grep -q "on http://" "$run/serve.log" && break; sleep 0.2; done
port=$(sed -n 's/.*on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$run/serve.log")
python3 - "$port" "${want#The }" <<'PY'
import json, sys, urllib.request
body = json.dumps({"prompt": "The ", "max_tokens": 24, "temperature": 0.8, "top_k": 40, "seed": 3}).encode()
request = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/completions", body, {"Content-Type": "application/json"})
text = json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["text"]
want = sys.argv[2].encode("utf-8", "surrogateescape").decode("utf-8", "replace")  # the server sends U+FFFD for stray bytes
assert text == want, (text, want)
print("served with streamed weights:", repr(text))
PY
kill -TERM "$server"
wait "$server"
server=""

if "$meshtrain" generate --checkpoint "$ckpt" --offload.weights disk > "$run/bad.log" 2>&1; then exit 1; fi
grep -q "offload.weights" "$run/bad.log"
if "$meshtrain" train --model.preset=tiny --offload.optimizer=cpu > "$run/bad2.log" 2>&1; then exit 1; fi
grep -q "offload.optimizer = \"cpu\": needs parallel.zero_stage >= 1" "$run/bad2.log" || { cat "$run/bad2.log"; exit 1; }
echo "ok: offloaded training equals resident; streamed generation and serving under a quarter of the model"
