"""Generation speed of meshtrain against Hugging Face transformers' generate()
on the same model and weights, with the same threads, in one run.

A random-weight model is built by transformers and saved, imported with
`meshtrain import hf`, then for each batch size both generate greedily from the
same prompt: meshtrain through `meshtrain bench generate` (the serving path:
the continuous-batching engine and its KV cache), transformers through
model.generate() with its KV cache. Prefill (a forward over the prompt) and
decode (generate() minus prefill) are timed apart; medians of --trials. Row 0's
tokens are compared too (greedy: they should be the same). Run from the
repository root with the project's virtual environment:

    .venv/bin/python bench/generate_vs_hf.py [--model gpt2-124m|llama-110m] [--batches 1 16] [--trials 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")

MODELS = {
    "gpt2-124m": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=1024)),
    "llama-110m": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=1024)),
}


def hf_run(model, prompt, batch, new_tokens, trials):
    ids = torch.tensor([prompt] * batch)
    prefill, total, tokens = [], [], None
    with torch.no_grad():
        for trial in range(trials + 1):  # the first untimed
            start = time.perf_counter()
            model(ids, use_cache=True)
            prefilled = time.perf_counter() - start
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, attention_mask=torch.ones_like(ids))
            elapsed = time.perf_counter() - start
            if trial:
                prefill.append(prefilled)
                total.append(elapsed)
            tokens = out[0, ids.shape[1]:].tolist()
    p, t = statistics.median(prefill), statistics.median(total)
    return {"prefill_s": p, "decode_s": t - p, "prefill_tokens_per_s": batch * len(prompt) / p,
            "decode_tokens_per_s": batch * (new_tokens - 1) / (t - p), "tokens": tokens}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="gpt2-124m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = MODELS[args.model]().eval()
    vocab = model.config.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(args.prompt_tokens)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    print(f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{args.threads} threads, prompt {args.prompt_tokens}, {args.new_tokens} new tokens, "
          f"transformers {transformers.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as work:
        model.save_pretrained(os.path.join(work, "hf"), safe_serialization=True)
        subprocess.run([MESHTRAIN, "import", "hf", os.path.join(work, "hf"), "--out", os.path.join(work, "ckpt"),
                        "--tokenizer", "bytes"], check=True, capture_output=True, env=env)
        print(f"{'batch':>5} {'phase':>8} {'meshtrain tok/s':>16} {'transformers tok/s':>19} {'ratio':>6}")
        for batch in args.batches:
            out = subprocess.run([MESHTRAIN, "bench", "generate", "--checkpoint", os.path.join(work, "ckpt"),
                                  "--batch", str(batch), "--prompt-tokens", str(args.prompt_tokens),
                                  "--new-tokens", str(args.new_tokens), "--trials", str(args.trials)],
                                 check=True, capture_output=True, text=True, env=env).stdout
            ours = json.loads(out.strip().splitlines()[-1])
            theirs = hf_run(model, prompt, batch, args.new_tokens, args.trials)
            for phase in ("prefill", "decode"):
                a, b = ours[f"{phase}_tokens_per_s"], theirs[f"{phase}_tokens_per_s"]
                print(f"{batch:>5} {phase:>8} {a:>16.1f} {b:>19.1f} {a / b:>6.2f}")
            same = ours["tokens"] == theirs["tokens"]
            print(f"{batch:>5} {'tokens':>8} {'the same' if same else 'DIFFERENT':>16}")


if __name__ == "__main__":
    main()
