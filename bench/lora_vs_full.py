"""LoRA against full fine-tuning, and against peft + PyTorch: the step time and
memory of one Llama-shaped model (width 512, 8 blocks, grouped-query
attention, SwiGLU; 23.5M parameters) trained on the same batch, context and
threads, with rank-16 adapters on q, k, v, o, gate, up, down.

Rows, each the median step time over the steps after the first two:
  meshtrain LoRA / full, 1 rank (all cores), and 2 ranks with ZeRO-3: step
  seconds, the counted model states per rank (parameters, gradients and
  optimizer states from the counting allocator) and the peak RSS per rank;
  PyTorch + peft LoRA / full (transformers' LlamaForCausalLM, AdamW, the
  same accumulation): step seconds and peak RSS.

usage: lora_vs_full.py MESHTRAIN [--steps 8] [--repeats 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "..", "shared", "data", "tinyshakespeare.txt")
WIDTH, LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB, CONTEXT = 512, 8, 8, 4, 1376, 256, 256
BATCH, MICRO, RANK, ALPHA = 8, 4, 16, 32
TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
MODEL = [f"--model.width={WIDTH}", f"--model.layers={LAYERS}", f"--model.heads={HEADS}", f"--model.kv_heads={KV_HEADS}",
         f"--model.ffn_hidden={HIDDEN}", f"--model.vocab_size={VOCAB}", f"--model.context={CONTEXT}",
         "--model.norm=rmsnorm", "--model.position=rope", "--model.mlp=swiglu", "--model.bias=false",
         "--model.tie_embeddings=false", "--model.dropout=0"]


def meshtrain_run(a, work, ranks, lora, *layout):
    out = os.path.join(work, f"run-{len(os.listdir(work))}")
    launch = [a.meshtrain] if ranks == 1 else [a.meshtrain, "run", "-n", str(ranks)]
    args = launch + ["train", f"--data.text={CORPUS}", *MODEL, f"--training.steps={a.steps}",
                     f"--training.batch={BATCH}", f"--training.micro_batch={MICRO // ranks if ranks > 1 else MICRO}",
                     "--training.eval_every=0", "--training.eval_batches=1", "--training.sample_tokens=0",
                     "--checkpoint.every=0", f"--run.out={out}", *layout]
    if lora:
        args += [f"--lora.rank={RANK}", f"--lora.alpha={ALPHA}"]
    subprocess.run(args, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"step_seconds"' in line]
    steady = rows[2:]
    return (statistics.median(r["step_seconds"] for r in steady),
            max(max(r["memory_mib"]["model_states"]) for r in steady),
            max(max(r["peak_rss_mib"]) for r in steady))


PYTORCH = r"""
import json, resource, sys, time
import torch, transformers, peft
WIDTH, LAYERS, HEADS, KV, HIDDEN, VOCAB, CONTEXT, BATCH, MICRO, RANK, ALPHA, STEPS, LORA = json.loads(sys.argv[1])
torch.manual_seed(0)
config = transformers.LlamaConfig(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                  num_key_value_heads=KV, intermediate_size=HIDDEN, vocab_size=VOCAB,
                                  max_position_embeddings=CONTEXT, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                  attn_implementation="sdpa")
model = transformers.LlamaForCausalLM(config)
if LORA:
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
ids = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1))
times = []
for step in range(STEPS):
    start = time.perf_counter()
    for m in range(BATCH // MICRO):
        x = ids[m * MICRO:(m + 1) * MICRO]
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1)) / (BATCH // MICRO)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - start)
times = sorted(times[2:])
print(json.dumps({"seconds": times[len(times) // 2], "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def pytorch_run(a, lora):
    spec = [WIDTH, LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB, CONTEXT, BATCH, MICRO, RANK, ALPHA, a.steps, lora]
    r = subprocess.run([sys.executable, "-c", PYTORCH, json.dumps(spec)], check=True, capture_output=True, text=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["seconds"], out["peak_rss_mib"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("meshtrain")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    a = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-lora-") as work:
        for _ in range(a.repeats):  # interleaved, so that drift on this noisy machine hits every row alike
            for lora in (True, False):
                kind = "LoRA" if lora else "full"
                results.setdefault(f"meshtrain {kind}, 1 rank", []).append(meshtrain_run(a, work, 1, lora))
                results.setdefault(f"meshtrain {kind}, 2 ranks ZeRO-3", []).append(
                    meshtrain_run(a, work, 2, lora, "--parallel.zero_stage=3"))
                results.setdefault(f"PyTorch + peft {kind}" if lora else "PyTorch full", []).append(pytorch_run(a, lora))
    print(f"model: width {WIDTH}, {LAYERS} blocks, heads {HEADS}/{KV_HEADS}, SwiGLU {HIDDEN}, context {CONTEXT}; "
          f"batch {BATCH}, micro-batch {MICRO}; LoRA r {RANK} on {','.join(TARGETS)}; medians of {a.repeats} runs")
    print(f"{'':34} {'step s':>8} {'states MiB/rank':>16} {'peak RSS MiB/rank':>18}")
    med = {}
    for name, runs in results.items():
        cols = list(zip(*runs))
        med[name] = [statistics.median(c) for c in cols]
        states = f"{med[name][1]:16.1f}" if len(cols) == 3 else f"{'':>16}"
        print(f"{name:34} {med[name][0]:8.3f} {states} {med[name][-1]:18.1f}")
    print("ratios (full / LoRA): 1 rank step %.2fx, states %.2fx; ZeRO-3 states per rank %.2fx; "
          "peft LoRA / meshtrain LoRA step time %.2fx" % (
              med["meshtrain full, 1 rank"][0] / med["meshtrain LoRA, 1 rank"][0],
              med["meshtrain full, 1 rank"][1] / med["meshtrain LoRA, 1 rank"][1],
              med["meshtrain full, 2 ranks ZeRO-3"][1] / med["meshtrain LoRA, 2 ranks ZeRO-3"][1],
              med["PyTorch + peft LoRA"][0] / med["meshtrain LoRA, 1 rank"][0]))


if __name__ == "__main__":
    main()
