"""Training throughput of each open family, meshtrain against PyTorch eager
running the transformers implementation of the same config, in one run.

For each family (Llama 3.1, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE,
Gemma 2, Phi-3, OLMo 2) a tiny-scaled config (width 256, 4 blocks, 4 heads,
2 key/value heads, context 256, vocabulary 256 (bytes); the family's features on)
is trained alternately by `meshtrain bench train` and by a loop over
transformers' model of that config (AutoModelForCausalLM, fp32 weights,
AdamW, gradient clipping; bf16 autocast for --dtype bfloat16), with the same
threads, batch, micro-batch and steps. Both sides get the config from the
same place: the transformers model is saved, `meshtrain import hf` reads it,
so the shapes cannot drift apart. Prints median tokens/s of each side,
their ratio, both sides' MFU (the FLOPs the model needs, attention's masked
keys left out, against the matmul peak meshtrain measures in its run) and
the ratio a step at that peak would reach. Run from the repository root:

    .venv/bin/python bench/families_vs_transformers.py [--families llama3.1 qwen3] [--dtype bfloat16]
        [--repeats 3] [--steps 6]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import transformers as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")
BASE = dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500000.0}
FAMILIES = {
    "llama3.1": lambda: T.LlamaConfig(**BASE, rope_parameters=LLAMA3),
    "mistral": lambda: T.MistralConfig(**BASE, sliding_window=64),
    "qwen2": lambda: T.Qwen2Config(**BASE, use_sliding_window=False),
    "qwen3": lambda: T.Qwen3Config(**BASE, head_dim=64),
    "mixtral": lambda: T.MixtralConfig(**{**BASE, "intermediate_size": 256}, num_local_experts=8,
                                       num_experts_per_tok=2, sliding_window=None),
    "qwen3-moe": lambda: T.Qwen3MoeConfig(**BASE, head_dim=64, num_experts=16, num_experts_per_tok=4,
                                          moe_intermediate_size=128, norm_topk_prob=True),
    "gemma2": lambda: T.Gemma2Config(**BASE, head_dim=64, sliding_window=64, query_pre_attn_scalar=64),
    "phi3": lambda: T.Phi3Config(**BASE),
    "olmo2": lambda: T.Olmo2Config(**BASE),
}


def last_json(output):
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no JSON line in output:\n" + output[-4000:])


def meshtrain_side(checkpoint_config, args, threads):
    """`meshtrain bench train` with the imported model's [model] keys."""
    overrides = [f"--model.{k}={json.dumps(v) if isinstance(v, str) else str(v).lower()}"
                 for k, v in checkpoint_config.items() if k != "moe"]
    for k, v in checkpoint_config.get("moe", {}).items():
        overrides.append(f"--model.moe_{k}={json.dumps(v) if isinstance(v, str) else str(v).lower()}")
    overrides = [o.replace('"', "") for o in overrides]
    command = [MESHTRAIN, "bench", "train", "--steps", str(args.steps), "--warmup-steps", "2",
               f"--training.batch={args.batch}", f"--training.micro_batch={args.micro_batch}",
               f"--training.dtype={args.dtype}", "--model.dropout=0"] + overrides
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}")
    result = last_json(done.stdout)
    peak = result["matmul_peak_gflops_per_rank"] * 1e9 * result["ranks"]
    return result["tokens_per_s"], result["mfu"] * peak / result["tokens_per_s"], peak


def attention_flops(config, kind):
    """Training FLOPs per token of the attention scores and their use in all
    layers: every query against every key (meshtrain's count, `kind` None), or
    only the keys a causal mask and the family's sliding windows leave."""
    s = config.max_position_embeddings
    heads = config.num_attention_heads
    q_width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    types = getattr(config, "layer_types", None) or ["sliding_attention" if getattr(config, "sliding_window", None)
                                                     else "full_attention"] * config.num_hidden_layers
    total = 0
    for layer_type in types:
        window = config.sliding_window if layer_type == "sliding_attention" else s
        pairs = s * s if kind is None else sum(min(i + 1, window) for i in range(s))
        total += 12 * q_width * pairs / s  # q·k and p·v, 2 FLOPs each, three times for training
    return total


def pytorch_side(model, config, args):
    context, vocab = config.max_position_embeddings, config.vocab_size
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    accumulation = args.batch // args.micro_batch
    generator = torch.Generator().manual_seed(0)
    model.train()

    def step():
        optimizer.zero_grad(set_to_none=False)
        for _ in range(accumulation):
            tokens = torch.randint(0, vocab, (args.micro_batch, context + 1), generator=generator)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
                logits = model(tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    seconds = []
    for i in range(2 + args.steps):
        start = time.perf_counter()
        step()
        if i >= 2:
            seconds.append(time.perf_counter() - start)
    return args.batch * context / statistics.median(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    print(f"transformers {T.__version__}, torch {torch.__version__}, {threads} threads, {args.dtype}", flush=True)
    rows = []
    for family in args.families:
        config = FAMILIES[family]()
        try:  # PyTorch's fused attention where transformers has it for the family (Gemma 2: eager)
            model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except ValueError:
            model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        with tempfile.TemporaryDirectory() as work:
            model.save_pretrained(os.path.join(work, "hf"), safe_serialization=True)
            subprocess.run([MESHTRAIN, "import", "hf", os.path.join(work, "hf"), "--out", os.path.join(work, "c"),
                            "--tokenizer", "bytes"], check=True, capture_output=True)
            latest = open(os.path.join(work, "c", "latest")).read().strip()
            meta = json.load(open(os.path.join(work, "c", latest, "metadata.json")))
            model_config = json.loads(meta["model_config"]) if isinstance(meta.get("model_config"), str) \
                else meta.get("model_config", meta.get("model"))
        ours, theirs, peaks = [], [], []
        for _ in range(args.repeats):
            tokens_per_s, flops_per_token, peak = meshtrain_side(model_config, args, threads)
            ours.append(tokens_per_s)
            peaks.append(peak)
            theirs.append(pytorch_side(model, config, args))
        row = {"family": family, "dtype": args.dtype, "meshtrain_tokens_per_s": statistics.median(ours),
               "transformers_tokens_per_s": statistics.median(theirs),
               "ratio": statistics.median(ours) / statistics.median(theirs)}
        needed = flops_per_token - attention_flops(config, None) + attention_flops(config, "causal")
        peak = statistics.median(peaks)
        # MFU: the FLOPs a step cannot do without (meshtrain's count, with only the
        # keys the masks leave) over the matmul peak meshtrain measured in its
        # run. No step runs faster than that, so 1 / transformers' MFU bounds the ratio.
        row["meshtrain_mfu"] = needed * row["meshtrain_tokens_per_s"] / peak
        row["transformers_mfu"] = needed * row["transformers_tokens_per_s"] / peak
        row["ratio_ceiling"] = 1 / row["transformers_mfu"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| family | meshtrain tokens/s | transformers (PyTorch eager) tokens/s | ratio | MFU meshtrain / "
          "transformers | ratio at the matmul peak |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['meshtrain_tokens_per_s']:.0f} | {r['transformers_tokens_per_s']:.0f} | "
              f"{r['ratio']:.2f}x | {r['meshtrain_mfu']:.2f} / {r['transformers_mfu']:.2f} | "
              f"{r['ratio_ceiling']:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
