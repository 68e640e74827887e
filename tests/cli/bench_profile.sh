#!/usr/bin/env bash
# meshtrain bench train --profile as a person runs it, bf16 on a tiny model:
# a Chrome trace and every operator's self time, with the fused operators and
# the CPU AdamW among them, the matrix products by operand sizes, and MFU
# against the bf16 peak (at most 100% where the CPU has bf16 instructions).
set -euo pipefail
meshtrain=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$meshtrain" bench train --steps 1 --warmup-steps 1 --profile "$dir/profile" --profile-steps 1 --model.preset=tiny \
  --model.layers=2 --training.dtype=bfloat16 --training.batch=4 --training.micro_batch=2 --run.out="$dir/run" \
  > "$dir/bench.txt" 2> "$dir/table.txt"
grep -q "all operators" "$dir/table.txt"
grep -q "all products" "$dir/table.txt"
python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
trace = json.load(open(d + "/profile/trace.json"))
assert trace["traceEvents"], "empty trace"
ops = {o["name"]: o for o in json.load(open(d + "/profile/ops.json"))}
for name in ("aten::mm", "meshtrain::fused_add_norm", "meshtrain::fused_bias_gelu_backward", "meshtrain::cpu_adamw"):
    assert name in ops and ops[name]["calls_per_step"] > 0, name
assert abs(sum(o["share"] for o in ops.values()) - 1) < 1e-6
# The products by operand sizes: each row's FLOPs are 2·m·k·n (times the batch)
# of its operands, and the blocks' linear layers are among them.
products = json.load(open(d + "/profile/products.json"))
assert products and any(p["name"] == "aten::mm" for p in products), products
for p in products:
    a, b = [[int(v) for v in part.strip(" []").split(",")] for part in p["operands"].split(" x ")]
    flops = 2 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1) * p["calls_per_step"]
    assert abs(p["gflop_per_step"] * 1e9 - flops) <= 1e-6 * flops, p
    assert p["gflops"] > 0 and p["share_of_peak"] > 0, p
row = json.loads([l for l in open(d + "/bench.txt") if l.startswith("{")][-1])
assert row["dtype"] == "bfloat16" and 0 < row["mfu"], row
# Where the CPU has no bf16 instructions, ATen emulates bf16 products below
# the fp32 rate, and training's fp32 parts outrun that "peak": no bound to check.
flags = open("/proc/cpuinfo").read().split()
if any(f in flags for f in ("avx512_bf16", "amx_bf16")):
    assert row["mfu"] <= 1, row
else:
    print(f"no bf16 instructions on this CPU: MFU {row['mfu']:.2f} against an emulated bf16 peak is not bounded")
PY
