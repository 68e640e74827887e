"""Hugging Face interop against transformers itself: random-weight GPT-2,
Llama, Mistral and Qwen2 models (grouped-query attention, tied and untied
heads, q/k/v biases, sharded files)
built and saved by transformers, imported into meshtrain, must give the same
logits (<= 1e-4); exported back, transformers must load them and give the same
logits again.

usage: hf_test.py MESHTRAIN
"""
import os
import subprocess
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from checks import Checks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logits  # noqa: E402
from logits import hf_logits  # noqa: E402

MESHTRAIN = sys.argv[1]
CHECKS = Checks(MESHTRAIN)
check, meshtrain = CHECKS.check, CHECKS.meshtrain
torch.manual_seed(0)


def meshtrain_logits(checkpoint, tokens, work):
    return logits.meshtrain_logits(meshtrain, checkpoint, tokens, work)


MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=300, n_positions=64, n_embd=48, n_layer=2, n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)),
    "gpt2 untied, n_inner": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=300, n_positions=64, n_embd=48, n_layer=2, n_head=4, n_inner=80, tie_word_embeddings=False)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6)),
    "llama GQA, rope_theta 500000, tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0, tie_word_embeddings=True)),
    "mistral, no sliding window": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=None)),
    "qwen2 (q, k, v biases), untied": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=False)),
}


def round_trip(name, build, work):
    model = build().eval()
    with torch.no_grad():  # random norms and biases too, so a swapped or missing one shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_dir = os.path.join(work, "hf")
    shard = "8KB" if "GQA" in name or "untied" in name else "5GB"
    model.save_pretrained(hf_dir, safe_serialization=True, max_shard_size=shard)
    sharded = os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json"))
    checkpoint = os.path.join(work, "checkpoints")
    if name == "gpt2":
        refused = subprocess.run([MESHTRAIN, "import", "hf", hf_dir, "--out", checkpoint], capture_output=True, text=True)
        check(refused.returncode == 1 and "--tokenizer bytes" in refused.stderr,
              "a folder without tokenizer files is refused, saying how to go on: " + refused.stderr.strip()[-90:])
    meshtrain("import", "hf", hf_dir, "--out", checkpoint, "--tokenizer", "bytes")
    tokens = [int(t) for t in torch.randint(0, 300, (40,))]
    want = hf_logits(model, tokens)
    got = meshtrain_logits(checkpoint, tokens, work)
    diff = (got - want).abs().max().item()
    check(diff <= 1e-4, f"{name}: imported{' (sharded)' if sharded else ''}, logits equal transformers' "
          f"(max difference {diff:.2e})")
    out_dir = os.path.join(work, "exported")
    meshtrain("export", "hf", checkpoint, "--out", out_dir, "--max-shard-size", "20K" if sharded else "5G")
    again = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    diff = (hf_logits(again, tokens) - want).abs().max().item()
    resharded = os.path.exists(os.path.join(out_dir, "model.safetensors.index.json"))
    check(diff <= 1e-4 and resharded == sharded,
          f"{name}: exported{' (sharded)' if resharded else ''}, transformers loads it with the same logits "
          f"(max difference {diff:.2e})")


def main():
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for name, build in MODELS.items():
        with tempfile.TemporaryDirectory() as work:
            round_trip(name, build, work)
    # A model meshtrain trained goes out and comes back with the same logits.
    with tempfile.TemporaryDirectory() as work:
        run = os.path.join(work, "run")
        meshtrain("train", "--model.preset=llama-tiny", "--model.layers=2", "--model.kv_heads=2",
                  "--training.steps=2", "--training.batch=2", "--training.micro_batch=2",
                  "--training.sample_tokens=0", f"--run.out={run}")
        out_dir = os.path.join(work, "exported")
        meshtrain("export", "hf", os.path.join(run, "checkpoints"), "--out", out_dir)
        tokens = list(range(10, 50))
        theirs = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval(), tokens)
        ours = meshtrain_logits(os.path.join(run, "checkpoints"), tokens, work)
        diff = (theirs - ours).abs().max().item()
        check(diff <= 1e-4, f"a trained llama-tiny (GQA) exported: transformers' logits equal meshtrain's ({diff:.2e})")
        # Its byte tokenizer goes out as a tokenizer.json transformers loads: ids are the UTF-8 bytes, and back.
        tok = transformers.AutoTokenizer.from_pretrained(out_dir)
        text = "Straße, café: 東京 😀\n\tend "
        ids = tok.encode(text, add_special_tokens=False)
        check(ids == list(text.encode()) and tok.decode(ids) == text,
              "the byte tokenizer is exported as a tokenizer.json whose ids are the text's bytes")
    # What meshtrain does not implement is refused by name: families_test.py.
    CHECKS.finish()


if __name__ == "__main__":
    main()
