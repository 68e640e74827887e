#!/usr/bin/env bash
# meshtrain plan as a person runs it: the ranked table for Llama-2 7B on 8
# devices, JSON, one layout explained, a config file's own layout, a machine
# profile file used, --auto's config trained; bad input fails with a message.
set -euo pipefail
meshtrain=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$meshtrain" plan --model llama2-7b --world 8 --device-memory 80GiB | tee "$dir/table.txt"
grep -q "llama2-7b: 6.74B parameters, 32 layers" "$dir/table.txt"
grep -q "fastest layouts that fit" "$dir/table.txt"
grep -q "closest that do not fit:" "$dir/table.txt"
grep -q "needs .* GiB > 80.0 GiB on pipeline rank" "$dir/table.txt"
grep -q "^machine  .*(this machine" "$dir/table.txt" || { echo "the default machine is not this one"; exit 1; }
"$meshtrain" plan --model llama2-7b --world 8 --machine h100 --top 1 | grep -q "^machine  h100: 989 TFLOP/s .*(the h100 profile)"
# train's key for the precision: bfloat16 is --precision bf16-autocast (what train does), float32 is fp32
"$meshtrain" plan --model llama2-7b --world 8 --machine h100 --top 1 --training.dtype=bfloat16 | grep -q "^run .* bf16-autocast,"
"$meshtrain" plan --model llama2-7b --world 8 --machine h100 --top 1 --training.dtype=float32 | grep -q "^run .* fp32,"

# The model of a Hugging Face folder (its config.json alone) and of a checkpoint; this machine's memory by default.
mkdir -p "$dir/hf"
cat > "$dir/hf/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
 "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
 "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": true,
 "attn_implementation": "sdpa"}
JSON
"$meshtrain" plan --model "$dir/hf" --world 4 --top 1 > "$dir/hf.txt"
grep -q "hf: 1.24B parameters, 16 layers, h 2048, 32 heads (8 kv)" "$dir/hf.txt" &&
  grep -q "(this machine" "$dir/hf.txt" || { cat "$dir/hf.txt"; exit 1; }
if [ ! -d /proc/driver/nvidia/gpus ]; then  # a CPU host: its memory shared by the 4 ranks
  python3 - "$dir/hf.txt" <<'PY'
import os, re, sys
per_rank = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 4 / 2**30
shown = float(re.search(r"^run .*?, ([\d.]+) GiB per device", open(sys.argv[1]).read(), re.M).group(1))
assert abs(shown - per_rank) < 0.1, (shown, per_rank)
PY
fi
"$meshtrain" train --model.preset=tiny --model.layers=1 --training.steps=1 --training.batch=2 --training.micro_batch=2 \
  --training.sample_tokens=0 --run.out="$dir/run" > /dev/null
"$meshtrain" plan --model "$dir/run/checkpoints" --world 2 --top 1 > "$dir/ckpt.txt"
grep -q "checkpoints: 889K parameters, 1 layers, h 256" "$dir/ckpt.txt" || { cat "$dir/ckpt.txt"; exit 1; }
"$meshtrain" plan --model llama2-7b --world 8 --machine h100 --json --top 3 > "$dir/plan.json"
python3 - "$dir/plan.json" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
assert plan["parameters"] == 6738415616, plan["parameters"]
assert len(plan["best"]) == 3 and all(c["fits"] for c in plan["best"])
assert plan["best"][0]["time_seconds"]["step"] <= plan["best"][1]["time_seconds"]["step"]
assert all(not c["fits"] and "needs" in c["why_not"] for c in plan["closest_rejected"])
PY
"$meshtrain" plan --model gpt3-175b --world 1024 --layout "pp=8 1f1b tp=8 sp dp=16 zero=1 mb=1 recompute=selective" \
  | tee "$dir/one.txt"
grep -q "layout   pp=8 1f1b tp=8 sp zero=1 fsdp=16 mb=1 recompute=selective" "$dir/one.txt"
grep -q "^  7  " "$dir/one.txt"  # a row per pipeline rank
# Mixture of experts: total and active parameters, expert parallel in the search, all-to-all traffic.
"$meshtrain" plan --model mixtral-8x7b --world 64 --layout "pp=8 ep=8" | tee "$dir/moe.txt"
grep -q "mixtral-8x7b: 46.70B parameters.*8 experts top-2 in every block, 12.88B active" "$dir/moe.txt"
grep -q "ep   all-to-all tokens to and from experts" "$dir/moe.txt"
"$meshtrain" plan --model mixtral-8x7b --world 64 --machine h100 --json --top 50 > "$dir/moe.json"
python3 - "$dir/moe.json" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
assert plan["active_parameters"] < plan["parameters"] / 3, plan
assert any("ep=" in c["layout"] for c in plan["best"]), [c["layout"] for c in plan["best"]]
PY
# The router's load from a training run's metrics: per step the mean over layers, then the median past step 1.
cat > "$dir/metrics.jsonl" <<'JSONL'
{"step": 1, "loss": 5.0, "moe": [{"block": 1, "rank_load": 2.0, "dropped": 0.5}]}
{"step": 2, "loss": 4.0, "moe": [{"block": 1, "rank_load": 1.1, "dropped": 0.1}, {"block": 3, "rank_load": 1.3, "dropped": 0.3}]}
{"step": 3, "loss": 3.9, "moe": [{"block": 1, "rank_load": 1.4, "dropped": 0.3}, {"block": 3, "rank_load": 1.4, "dropped": 0.3}]}
{"event": "eval", "val_loss": 3.8}
{"step": 4, "loss": 3.8, "moe": [{"block": 1, "rank_load": 1.0, "dropped": 0.1}, {"block": 3, "rank_load": 1.2, "dropped": 0.1}]}
JSONL
"$meshtrain" plan --model mixtral-8x7b --world 64 --moe-load "$dir/metrics.jsonl" > "$dir/moe-load.txt"
grep -q "experts  the busiest rank under expert parallel computes 1.20 x tokens x top_k per layer, a rank without it 0.80" \
  "$dir/moe-load.txt" || { cat "$dir/moe-load.txt"; exit 1; }
# Runs that report the load at every degree (any layout, ep = 1 too): each degree's own median.
cat > "$dir/by-ep.jsonl" <<'JSONL'
{"step": 1, "moe": [{"block": 1, "rank_load": 1.0, "ep": 1, "rank_load_by_ep": {"1": 1.0, "2": 3.0, "4": 3.0, "8": 3.0}}]}
{"step": 2, "moe": [{"block": 1, "rank_load": 1.0, "ep": 1, "rank_load_by_ep": {"1": 0.9, "2": 1.1, "4": 1.3, "8": 1.5}}, {"block": 3, "rank_load": 1.0, "ep": 1, "rank_load_by_ep": {"1": 0.9, "2": 1.3, "4": 1.5, "8": 1.9}}]}
{"step": 3, "moe": [{"block": 1, "rank_load": 1.0, "ep": 1, "rank_load_by_ep": {"1": 1.0, "2": 1.0, "4": 1.2, "8": 1.6}}]}
JSONL
"$meshtrain" plan --model mixtral-8x7b --world 64 --moe-load "$dir/by-ep.jsonl" > "$dir/by-ep.txt"
grep -q "by expert parallel degree: 1: 1.00 2: 1.20 4: 1.40 8: 1.70 (--moe-load)" "$dir/by-ep.txt" ||
  { cat "$dir/by-ep.txt"; exit 1; }
cat > "$dir/run.toml" <<'TOML'
[model]
preset = "tiny"
[training]
batch = 16
micro_batch = 2
[parallel]
pp = 2
pp_schedule = "1f1b"
TOML
"$meshtrain" plan --model "$dir/run.toml" --world 2 --layout config | tee "$dir/config.txt"
grep -q "layout   pp=2 1f1b mb=2, 8 micro-batches of 2" "$dir/config.txt"
grep -q "fp32" "$dir/config.txt"
# A profile file as --calibrate --save writes it (docs.run runs docs/planner.md's calibrate and the plan on its file).
cat > "$dir/machine.json" <<'JSON'
{"name": "calibrated", "peak_flops": 1.2e12, "mfu": 0.3, "intra_bandwidth": 5e9, "inter_bandwidth": 5e9,
 "latency": 2e-5, "host_bandwidth": 5e9, "devices_per_node": 2, "device_memory": 1.2e10}
JSON
"$meshtrain" plan --machine "$dir/machine.json" --model small --world 2 --layout "dp=2 mb=8" | grep -q "machine  calibrated"
# With measured operators (Note [Operator time]) the header says so, and a plan in another precision says what it counts.
cat > "$dir/operators.json" <<'JSON'
{"name": "calibrated", "peak_flops": 1.2e12, "mfu": 0.3, "devices_per_node": 2, "cores_per_node": 2,
 "operators": {"matmul_flops": 4e10, "matmul_call": 1e-6, "attention_flops": 2.5e10, "attention_call": 3e-4,
               "elementwise_bytes": 3e10, "elementwise_call": 1e-6, "overhead": 1.1, "precision": "fp32"}}
JSON
"$meshtrain" plan --machine "$dir/operators.json" --model small --world 2 --precision fp32 --layout "dp=2 mb=8" |
  grep -q "operators products 40 GFLOP/s + 1.0 us, attention 25 GFLOP/s + 300.0 us, elementwise 30 GB/s + 1.0 us, x 1.10"
"$meshtrain" plan --machine "$dir/operators.json" --model small --world 2 --precision bf16-mixed --layout "dp=2 mb=8" |
  grep -q "operators measured in fp32, not bf16-mixed: the step is its FLOPs at peak x MFU"
# Operators measured in bf16 serve train's bfloat16 autocast as they serve bf16-mixed: the same products.
sed 's/"precision": "fp32"/"precision": "bf16-mixed"/' "$dir/operators.json" > "$dir/operators-bf16.json"
"$meshtrain" plan --machine "$dir/operators-bf16.json" --model small --world 2 --training.dtype=bfloat16 --layout "dp=2 mb=8" |
  grep -q "operators products 40 GFLOP/s"
# This machine's cores are those the process may run on: its affinity mask (and a cgroup's quota).
if command -v taskset >/dev/null && [ "$(nproc)" -ge 2 ]; then
  taskset -c 0 "$meshtrain" plan --model small --world 2 --top 1 | grep -q "(1 cores)" ||
    { echo "plan counts CPUs outside the process's affinity mask"; exit 1; }
fi
# train's key names are plan's aliases: --model.context for --seq, --training.batch for --global-batch.
[ "$("$meshtrain" plan --model small --world 2 --machine h100 --model.context=128 --training.batch=64 --json --top 1)" = \
  "$("$meshtrain" plan --model small --world 2 --machine h100 --seq 128 --global-batch 64 --json --top 1)" ] ||
  { echo "--model.context / --training.batch do not mean --seq / --global-batch"; exit 1; }
# --auto: the fastest layout that fits a config on 4 ranks, written as a config train runs as it is, the
# config's other keys kept.
cat > "$dir/auto-source.toml" <<TOML
[model]
preset = "tiny"
layers = 2
[training]
batch = 8
steps = 1
sample_tokens = 0
[run]
out = "$dir/auto-run"
TOML
"$meshtrain" plan --model "$dir/auto-source.toml" --world 4 --auto "$dir/auto.toml" > "$dir/auto.txt"
grep -q "^# chosen: .*: predicted .* s per step" "$dir/auto.toml" && grep -q "^# runners-up" "$dir/auto.toml" &&
  grep -q "^steps = 1$" "$dir/auto.toml" && grep -q "^meshtrain: wrote $dir/auto.toml" "$dir/auto.txt" ||
  { cat "$dir/auto.txt"; exit 1; }
"$meshtrain" run -n 4 train "$dir/auto.toml" > "$dir/auto-train.txt" 2>&1
grep -q "^step     1/1 | loss" "$dir/auto-train.txt" || { cat "$dir/auto.toml" "$dir/auto-train.txt"; exit 1; }
# From a preset (bf16-mixed by default) --auto plans what train runs with bfloat16: autocast.
"$meshtrain" plan --model small --world 2 --auto "$dir/auto-small.toml" > /dev/null
grep -q "^# meshtrain plan --auto: .*, bf16-autocast$" "$dir/auto-small.toml" && grep -q '^dtype = "bfloat16"' "$dir/auto-small.toml" ||
  { cat "$dir/auto-small.toml"; exit 1; }
# torchtitan's recompute policy and whole-logits loss, for comparing with its runs: evaluated, not written by --auto.
"$meshtrain" plan --model llama3.1-8b --world 8 --seq 8192 --global-batch 16 --machine h100 --device-memory 96GiB \
  --layout "zero=3 fsdp=8 mb=2 recompute=selective" --selective ops --loss whole > "$dir/ops.txt"
grep -q "whole-logits loss, selective recompute op-level" "$dir/ops.txt" && grep -q "^  0 .* 31.06 " "$dir/ops.txt" ||
  { cat "$dir/ops.txt"; exit 1; }
expect_error() {  # message, then the plan arguments
  local message=$1; shift
  if "$meshtrain" plan "$@" > "$dir/bad.log" 2>&1; then echo "should have failed: $*"; exit 1; fi
  grep -qF -- "$message" "$dir/bad.log" || { cat "$dir/bad.log"; exit 1; }
}
expect_error "unknown model 'llama9'" --model llama9 --world 8
expect_error "plan --auto: no layout of 2 ranks fits 1.0 MiB per device" --model small --world 2 --device-memory 1MiB \
  --auto "$dir/none.toml"
expect_error "uses pp x dp x fsdp x ep x cp x tp = 4 ranks, not --world 8" --model llama2-7b --world 8 --layout tp=4
expect_error "tp(3) does not divide the attention heads (32)" --model llama2-7b --world 6 --layout "tp=3 dp=2"
expect_error "layout key 'tq' unknown" --model llama2-7b --world 8 --layout tq=8
expect_error "--selective ops models op-level recompute, which train does not run" --model small --world 2 \
  --selective ops --auto "$dir/ops.toml"
expect_error "--loss loss-parallel models PyTorch's loss_parallel, which train does not run" --model small --world 2 \
  --loss loss-parallel --auto "$dir/loss-parallel.toml"
expect_error "--pipeline-fsdp torch models FSDP2 under torch's pipelining, which train does not run" --model small \
  --world 2 --pipeline-fsdp torch --auto "$dir/torch-pp.toml"
expect_error "--moe-load 1.2x: give a load (e.g. 1.2) or a training run's metrics.jsonl" --model mixtral-8x7b --world 64 \
  --moe-load 1.2x
echo '{"step": 2, "moe": [{"block": 1, "rank_load": 0.8, "dropped": 0.2, "ep": 1}]}' > "$dir/ep1.jsonl"
expect_error "its run had no expert parallel (ep = 1) and reports no rank_load_by_ep" --model mixtral-8x7b --world 64 --moe-load "$dir/ep1.jsonl"
expect_error "no step in it reports the MoE layers' load" --model mixtral-8x7b --world 64 --moe-load "$dir/run.toml"
echo '{"step": 2, "moe": [{"block": 1, "rank_load_by_ep": {"1": 1.0, "2": 1.1, "4": 1.2}}]}' > "$dir/four.jsonl"
expect_error "its run had 4 experts per layer and this model has 8" --model mixtral-8x7b --world 64 \
  --moe-load "$dir/four.jsonl"
printf '[model]\npreset = "tiny"\n[parallel]\ntp = 2\ntp_impl = "annotations"\n' > "$dir/annotated.toml"
expect_error "--loss chunked: $dir/annotated.toml shards by annotations" --model "$dir/annotated.toml" --world 2 \
  --loss chunked
"$meshtrain" plan --model "$dir/annotated.toml" --world 2 --layout config | grep -q "whole-logits loss"
expect_error "unknown unit" --model llama2-7b --world 8 --device-memory 80apples
expect_error "machine 'h300' unknown: use this, h100, h200, a100 or a profile file" --model small --world 2 --machine h300
echo '{"mfu": "high"}' > "$dir/bad-machine.json"
expect_error "machine profile field 'mfu' must be a positive number" --model small --world 2 --machine "$dir/bad-machine.json"
echo "plan: all checks passed"
