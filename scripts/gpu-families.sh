#!/usr/bin/env bash
# The open families' features on a GPU against the CPU: for each feature set
# (Llama 3.1 rope scaling and biases, Qwen3 QK-norm and head size, Gemma 2
# sandwich norms, soft-caps and windows, Mistral window with yarn and partial
# rotary, OLMo 2 post-norms, Qwen-MoE top-k with a shared expert) trains the
# same small model 4 steps in fp32 on cuda and on the CPU and compares the
# losses (fp32 GPU kernels differ from the CPU's in rounding only), then 20
# steps in bf16 on cuda for tokens/s. Writes OUT_DIR/families.txt.
#
#   bash scripts/gpu-families.sh OUT_DIR [BUILD_DIR]
set -uo pipefail
root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: gpu-families.sh OUT_DIR [BUILD_DIR]}
build_dir=${2:-"$root_dir/build-gpu"}
meshtrain="$build_dir/bin/meshtrain"
mkdir -p "$out"
common=(--model.preset=llama-tiny --model.layers=4 --model.width=256 --model.heads=8 --model.context=256
        --model.dropout=0 --training.batch=8 --training.micro_batch=8 --training.sample_tokens=0
        --data.text="$root_dir/docs" --checkpoint.every=0)
declare -A families=(
  [llama3.1]="--model.kv_heads=2 --model.rope_scaling=llama3 --model.rope_factor=8 --model.rope_original_context=64 --model.rope_theta=500000 --model.attention_bias=true --model.mlp_bias=true"
  [qwen3]="--model.kv_heads=4 --model.head_size=64 --model.qk_norm=head --model.qkv_bias=true"
  [gemma2]="--model.mlp=geglu --model.norm_placement=sandwich --model.norm_plus_one=true --model.embed_scale=true --model.attn_softcap=50 --model.logit_softcap=30 --model.query_scale=32 --model.sliding_window=64 --model.sliding_every=2 --model.tie_embeddings=true"
  [mistral]="--model.kv_heads=2 --model.sliding_window=64 --model.rope_scaling=yarn --model.rope_factor=4 --model.rope_original_context=64 --model.rotary_fraction=0.5"
  [olmo2]="--model.norm_placement=post --model.qk_norm=width"
  [qwen-moe]="--model.moe_experts=16 --model.moe_top_k=4 --model.moe_every=1 --model.moe_hidden=128 --model.moe_capacity_factor=0 --model.moe_norm_topk=false --model.moe_shared_hidden=256 --model.qk_norm=head --model.moe_second_expert=always"
)
losses() { grep '"loss"' "$1/metrics.jsonl" | grep -o '"loss": *[0-9.e+-]*' | head -4 | sed 's/.*: *//' | paste -sd' '; }
status=0
exec > >(tee "$out/families.txt") 2>&1
printf '%-9s %-44s %-44s %s\n' family "losses, cuda fp32" "losses, cpu fp32" "bf16 cuda tokens/s"
for family in llama3.1 qwen3 gemma2 mistral olmo2 qwen-moe; do
  read -r -a keys <<< "${families[$family]}"
  for device in cuda cpu; do
    "$meshtrain" train "${common[@]}" "${keys[@]}" --training.steps=4 --run.device=$device \
      --run.out="$out/run-$family-$device" > "$out/$family-$device.log" 2>&1 || status=1
done
  speed=$("$meshtrain" bench train "${common[@]}" "${keys[@]}" --run.device=cuda --training.dtype=bfloat16 \
            --steps 20 2>&1 | grep -o '"tokens_per_s": *[0-9.]*' | sed 's/.*: *//' | tail -1)
  gpu=$(losses "$out/run-$family-cuda"); cpu=$(losses "$out/run-$family-cpu")
  printf '%-9s %-44s %-44s %s\n' "$family" "$gpu" "$cpu" "${speed:-failed}"
  python3 - "$gpu" "$cpu" <<'EOF' || status=1
import sys
g, c = [list(map(float, s.split())) for s in sys.argv[1:3]]
worst = max(abs(a - b) / b for a, b in zip(g, c)) if g and len(g) == len(c) else float("inf")
print(f"          worst relative loss difference {worst:.2e}", "ok" if worst <= 1e-3 else "FAIL")
sys.exit(0 if worst <= 1e-3 else 1)
EOF
  rm -rf "$out/run-$family-cuda" "$out/run-$family-cpu"
done
exit $status
