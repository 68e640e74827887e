"""The open families against transformers itself: for each of Llama 3.1
(llama3, linear and yarn rope scaling, attention and MLP biases), Mistral (a
sliding window), Qwen2, Qwen3 (QK-norm, a head size of its own), Mixtral,
Qwen3-MoE, Gemma 2, Phi-3 (fused weights, partial rotary) and OLMo 2, a tiny
random-weight model built and saved by transformers is imported; its logits
must equal transformers' (fp32, <= 1e-4) over 48 tokens (past the window and
the original RoPE context); greedy KV-cache generation must give
transformers' tokens; exported back, transformers must load it with the same
logits. Then what meshtrain does not implement is refused by name, and the
presets' parameter counts equal those of transformers' models of the published
configs (built on the meta device) and the published totals.

usage: families_test.py MESHTRAIN
"""
import json
import os
import subprocess
import sys
import tempfile

import torch
import transformers as T

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from checks import Checks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logits  # noqa: E402
from logits import hf_logits  # noqa: E402

MESHTRAIN = sys.argv[1]
CHECKS = Checks(MESHTRAIN)
check, meshtrain = CHECKS.check, CHECKS.meshtrain
torch.manual_seed(0)

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def config(cls, **kw):
    return cls(**{**BASE, **kw})


LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}
FAMILIES = {
    "llama 3.1 (llama3 rope scaling, attention and MLP biases)": lambda: T.LlamaForCausalLM(config(
        T.LlamaConfig, rope_parameters=LLAMA3, attention_bias=True, mlp_bias=True)),
    "llama (linear rope scaling)": lambda: T.LlamaForCausalLM(config(
        T.LlamaConfig, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "llama (yarn, head size 24)": lambda: T.LlamaForCausalLM(config(
        T.LlamaConfig, head_dim=24, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                     "original_max_position_embeddings": 16})),
    "mistral (sliding window 8)": lambda: T.MistralForCausalLM(config(T.MistralConfig, sliding_window=8)),
    "qwen2 (q, k, v biases)": lambda: T.Qwen2ForCausalLM(config(T.Qwen2Config, use_sliding_window=False)),
    "qwen3 (QK-norm, head size 24, tied)": lambda: T.Qwen3ForCausalLM(config(
        T.Qwen3Config, head_dim=24, tie_word_embeddings=True)),
    "mixtral (4 experts, top 2)": lambda: T.MixtralForCausalLM(config(
        T.MixtralConfig, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3-moe (8 experts, top 3, not renormalised)": lambda: T.Qwen3MoeForCausalLM(config(
        T.Qwen3MoeConfig, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False,
        head_dim=16)),
    "qwen3-moe (renormalised top 2)": lambda: T.Qwen3MoeForCausalLM(config(
        T.Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        head_dim=16)),
    "gemma 2 (soft-caps, window 8 every other block)": lambda: T.Gemma2ForCausalLM(config(
        T.Gemma2Config, head_dim=24, sliding_window=8, query_pre_attn_scalar=20, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0)),
    "phi-3 (fused q/k/v and gate/up, half the dims rotated)": lambda: T.Phi3ForCausalLM(config(
        T.Phi3Config, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "olmo 2 (post-norms, QK-norm over all heads)": lambda: T.Olmo2ForCausalLM(config(T.Olmo2Config)),
}


def meshtrain_logits(checkpoint, tokens, work):
    return logits.meshtrain_logits(meshtrain, checkpoint, tokens, work)


def same_greedy(model, prompt, ours, theirs):
    """Equal, or they part where transformers' best two logits tie (<= 1e-4)."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            top = hf_logits(model, prompt + theirs[:i])[0, -1].topk(2).values
            return (top[0] - top[1]).item() <= 1e-4, i
    return len(ours) == len(theirs), len(ours)


# Families whose features change what tensor parallel splits or what streaming reads.
SPLIT_GENERATION = ["qwen3 (QK-norm, head size 24, tied)", "gemma 2 (soft-caps, window 8 every other block)",
                    "qwen3-moe (8 experts, top 3, not renormalised)", "llama 3.1 (llama3 rope scaling, attention and MLP biases)"]


def split_generation(name, checkpoint, prompt, want):
    """Greedy tokens split over 2 tensor-parallel ranks, and with weights streamed from host memory
    (ZeRO-Inference), equal one rank's."""
    ids = ",".join(map(str, prompt))
    for what, command in [
        ("tp 2", [MESHTRAIN, "run", "-n", "2", "generate", "--parallel.tp=2"]),
        ("weights streamed from host memory", [MESHTRAIN, "generate", "--offload.weights=cpu"]),
    ]:
        out = subprocess.run(command + ["--checkpoint", checkpoint, "--prompt-ids", ids, "--tokens", "40",
                                        "--temperature", "0"], capture_output=True, text=True)
        got = [int(t) for t in out.stdout.strip().split(",")] if out.returncode == 0 and out.stdout.strip() else []
        check(got == want, f"{name}: greedy tokens with {what} equal one rank's" +
              ("" if got == want else ": " + out.stderr.strip()[-300:]))


def round_trip(name, build, work):
    model = build().eval()
    with torch.no_grad():  # random norms and biases too, so a swapped or missing one shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_dir = os.path.join(work, "hf")
    sharded = "mixtral" in name
    model.save_pretrained(hf_dir, safe_serialization=True, max_shard_size="20KB" if sharded else "5GB")
    checkpoint = os.path.join(work, "checkpoints")
    meshtrain("import", "hf", hf_dir, "--out", checkpoint, "--tokenizer", "bytes")
    tokens = [int(t) for t in torch.randint(0, 256, (48,))]
    want = hf_logits(model, tokens)
    diff = (meshtrain_logits(checkpoint, tokens, work) - want).abs().max().item()
    check(diff <= 1e-4, f"{name}: imported, logits over 48 tokens equal transformers' (max difference {diff:.2e})")

    prompt = tokens[:12]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
    out = subprocess.run([MESHTRAIN, "generate", "--checkpoint", checkpoint, "--prompt-ids", ",".join(map(str, prompt)),
                          "--tokens", "40", "--temperature", "0"], capture_output=True, text=True)
    ours = [int(t) for t in out.stdout.strip().split(",")] if out.returncode == 0 and out.stdout.strip() else []
    same, at = same_greedy(model, prompt, ours, theirs)
    check(same, f"{name}: 40 greedy tokens with the KV cache equal transformers' generate "
          f"({'all equal' if at == len(theirs) else f'first {at} equal, then a tie'})" +
          ("" if same else ": " + out.stderr.strip()[-200:]))

    if name in SPLIT_GENERATION:
        split_generation(name, checkpoint, prompt, ours)
    if name.startswith("mistral"):
        for bad, expect in [("1,abc", '"abc" is not a token id'), ("5,99999", '"99999" is not a token id'),
                            ("3,,4", '"" is not a token id')]:
            out = subprocess.run([MESHTRAIN, "generate", "--checkpoint", checkpoint, "--prompt-ids", bad, "--tokens",
                                  "4"], capture_output=True, text=True)
            check(out.returncode == 1 and out.stderr.count(expect) == 1,
                  f"--prompt-ids {bad} is refused once, naming it: {out.stderr.strip()[-120:]}")

    out_dir = os.path.join(work, "exported")
    meshtrain("export", "hf", checkpoint, "--out", out_dir, "--max-shard-size", "20K" if sharded else "5G")
    again = T.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    diff = (hf_logits(again, tokens) - want).abs().max().item()
    check(diff <= 1e-4, f"{name}: exported as {again.config.model_type}, transformers loads it with the same "
          f"logits (max difference {diff:.2e})")


def to_v4(j):
    """config.json as transformers 4 wrote it: rope_theta and rope_scaling instead of rope_parameters."""
    rope = j.pop("rope_parameters")
    j["rope_theta"] = rope.pop("rope_theta")
    j["rope_scaling"] = None if rope.get("rope_type") == "default" else rope


# Keys real Hub configs carry that transformers 5 no longer writes, each with its family.
HUB_QUIRKS = {
    "llama 3.1 as transformers 4 saved it": (lambda: T.LlamaForCausalLM(config(T.LlamaConfig, rope_parameters=LLAMA3)),
                                             to_v4),
    "qwen2.5 with use_mrope and a window it does not use": (
        lambda: T.Qwen2ForCausalLM(config(T.Qwen2Config, use_sliding_window=False)),
        lambda j: j.update({"use_mrope": False, "sliding_window": 131072, "max_window_layers": 28})),
    "gemma 2 with sliding_window_size": (
        lambda: T.Gemma2ForCausalLM(config(T.Gemma2Config, head_dim=16, sliding_window=8)),
        lambda j: j.update({"sliding_window_size": 8, "cache_implementation": "hybrid"})),
    # Keys a user's own script leaves that choose how transformers runs, not what it computes.
    "mistral saved by a script that picked its kernels and cache": (
        lambda: T.MistralForCausalLM(config(T.MistralConfig, sliding_window=8)),
        lambda j: j.update({"attn_implementation": "sdpa", "_attn_implementation_autoset": True,
                            "use_flash_attention_2": False, "pretraining_tp": 1, "gradient_checkpointing": True,
                            "max_length": 20, "do_sample": False, "temperature": 1.0, "top_p": 1.0,
                            "num_beams": 1, "repetition_penalty": 1.0})),
    "phi-3 with attention_bias and rope_scaling null": (
        lambda: T.Phi3ForCausalLM(config(T.Phi3Config)),
        lambda j: (to_v4(j), j.update({"attention_bias": False}))),
}


def hub_quirks():
    for name, (build, edit) in HUB_QUIRKS.items():
        with tempfile.TemporaryDirectory() as work:
            model = build().eval()
            folder = os.path.join(work, "hf")
            model.save_pretrained(folder, safe_serialization=True)
            path = os.path.join(folder, "config.json")
            j = json.load(open(path))
            edit(j)
            json.dump(j, open(path, "w"))
            checkpoint = os.path.join(work, "c")
            meshtrain("import", "hf", folder, "--out", checkpoint, "--tokenizer", "bytes")
            tokens = [int(t) for t in torch.randint(0, 256, (40,))]
            diff = (meshtrain_logits(checkpoint, tokens, work) - hf_logits(model, tokens)).abs().max().item()
            check(diff <= 1e-4, f"{name}: imported with transformers' logits (max difference {diff:.2e})")


def refused(work, cls, cfg_kwargs, expect, what, edit=None):
    folder = os.path.join(work, what.replace(" ", "_"))
    cls(config(getattr(T, cls.__name__.replace("ForCausalLM", "Config")), **cfg_kwargs)).save_pretrained(
        folder, safe_serialization=True)
    if edit:
        path = os.path.join(folder, "config.json")
        j = json.load(open(path))
        edit(j)
        json.dump(j, open(path, "w"))
    out = subprocess.run([MESHTRAIN, "import", "hf", folder, "--out", os.path.join(folder, "c")], capture_output=True,
                         text=True)
    check(out.returncode == 1 and expect in out.stderr, f"{what} is refused by name: {out.stderr.strip()[-160:]}")


def refusals():
    with tempfile.TemporaryDirectory() as work:
        refused(work, T.LlamaForCausalLM, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
                "rope_type \"dynamic\"", "dynamic rope scaling")
        refused(work, T.Qwen2ForCausalLM, {"use_sliding_window": True, "sliding_window": 8},
                "use_sliding_window", "Qwen2's sliding window")
        refused(work, T.LlamaForCausalLM, {}, "\"logit_scale\"", "a key no family has",
                edit=lambda j: j.update({"logit_scale": 0.5}))
        refused(work, T.MixtralForCausalLM, {"num_local_experts": 4, "router_jitter_noise": 0.1},
                "router_jitter_noise", "Mixtral's router jitter")


# Published configs (Hugging Face Hub config.json) and totals (model cards).
PRESETS = {
    "llama3.2-1b": (T.LlamaConfig, dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                        tie_word_embeddings=True), 1.24e9),
    "llama3.2-3b": (T.LlamaConfig, dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                                        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                                        tie_word_embeddings=True), 3.21e9),
    "llama3.1-8b": (T.LlamaConfig, dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8), 8.03e9),
    "llama3.1-70b": (T.LlamaConfig, dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                         num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8), 70.6e9),
    "llama3.1-405b": (T.LlamaConfig, dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                                          num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8),
                      405.9e9),
    "mistral-7b": (T.MistralConfig, dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8), 7.24e9),
    "mixtral-8x7b": (T.MixtralConfig, dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                           num_local_experts=8, num_experts_per_tok=2), 46.7e9),
    "qwen2.5-7b": (T.Qwen2Config, dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                       tie_word_embeddings=False), 7.62e9),
    "qwen3-0.6b": (T.Qwen3Config, dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, tie_word_embeddings=True), 0.6e9),
    "qwen3-8b": (T.Qwen3Config, dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                     head_dim=128, tie_word_embeddings=False), 8.19e9),
    "qwen3-30b-a3b": (T.Qwen3MoeConfig, dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                             head_dim=128, num_experts=128, num_experts_per_tok=8,
                                             moe_intermediate_size=768), 30.5e9),
    "gemma2-2b": (T.Gemma2Config, dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                                       head_dim=256), 2.61e9),
    "gemma2-9b": (T.Gemma2Config, dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                                       num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=256), 9.24e9),
    "phi3-mini": (T.Phi3Config, dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32), 3.82e9),
    "olmo2-7b": (T.Olmo2Config, dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32), 7.30e9),
}


def presets():
    for name, (cls, kw, published) in PRESETS.items():
        with torch.device("meta"):
            model = T.AutoModelForCausalLM.from_config(cls(**kw))
        theirs = sum(p.numel() for p in model.parameters())
        plan = json.loads(subprocess.run([MESHTRAIN, "plan", "--model", name, "--world", "8", "--json"],
                                         capture_output=True, text=True, check=True).stdout)
        ours = plan["parameters"]
        check(ours == theirs and abs(ours - published) / published < 0.01,
              f"preset {name}: {ours:,} parameters, transformers' model of the published config {theirs:,}, "
              f"published {published / 1e9:.2f}B")


def main():
    print(f"transformers {T.__version__}, torch {torch.__version__}")
    for name, build in FAMILIES.items():
        with tempfile.TemporaryDirectory() as work:
            round_trip(name, build, work)
    hub_quirks()
    refusals()
    presets()
    CHECKS.finish()


if __name__ == "__main__":
    main()
