"""LoRA fine-tuning end to end, as the README shows it: a Hugging Face Llama
(tiny, random, grouped-query attention) with its Llama 3 shaped tokenizer and
chat template is imported; 4 ranks with ZeRO-3 train LoRA adapters on the
chat records of examples/sft/shakespeare_chat.jsonl from the imported
weights; the adapters are exported for PEFT and merged for transformers, and
served on the base with --lora.

Checked against peft and transformers: the exported adapter loads with
peft.PeftModel.from_pretrained on the base and gives the logits meshtrain
gives for the adapter checkpoint; the merged export gives them in
transformers; greedy tokens of `generate --lora` equal peft's; the checkpoint
holds the adapters alone; a broken adapter folder is refused with a message
and the server still serves the good one.

usage: lora_test.py MESHTRAIN
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import peft
import safetensors.torch
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
sys.path.insert(0, os.path.join(HERE, "..", "serve"))
import hf_fixtures  # noqa: E402
from checks import Checks  # noqa: E402
from serving import Server  # noqa: E402

MESHTRAIN = sys.argv[1]
CHECKS = Checks(MESHTRAIN)
check = CHECKS.check
DATA = os.path.join(HERE, "..", "..", "examples", "sft", "shakespeare_chat.jsonl")
QUESTION = [{"role": "user", "content": 'Who says "Friends, Romans"?'}]


def train(work, name, *extra):
    args = [MESHTRAIN, "run", "-n", "4", "train", "--checkpoint.init_from=" + os.path.join(work, "base"),
            "--data.text=" + DATA, "--data.format=chat", "--data.packing=padded",
            "--model.context=96", "--parallel.zero_stage=3",  # the tokenizer: the base checkpoint's
            "--lora.rank=8", "--lora.alpha=16", "--training.batch=16", "--training.micro_batch=2",
            "--training.warmup=2", "--training.sample_tokens=0", "--training.eval_batches=2",
            "--run.out=" + os.path.join(work, name), *extra]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    rows = [json.loads(line) for line in open(os.path.join(work, name, "metrics.jsonl"))]
    return r.stdout, rows


def meshtrain_logits(work, checkpoint, ids):
    out = os.path.join(work, "logits.safetensors")
    CHECKS.meshtrain("logits", "--checkpoint", checkpoint, "--prompt-ids", ",".join(map(str, ids)), "--out", out)
    return safetensors.torch.load_file(out)["logits"][0]


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def main():
    with tempfile.TemporaryDirectory(prefix="meshtrain-lora-") as work:
        hf = os.path.join(work, "hf")
        corpus = hf_fixtures.write_corpus(os.path.join(work, "corpus.txt"))
        with open(corpus, "a") as f:
            f.write(open(DATA).read())
        fast = hf_fixtures.llama3_tokenizer(corpus, hf)
        hf_fixtures.tiny_llama(hf, fast, context=256)
        CHECKS.meshtrain("import", "hf", hf, "--out", os.path.join(work, "base"))

        # The base is random and its embedding and head frozen: the adapters move the loss less than full
        # fine-tuning does (data.sft), but they move it.
        out, rows = train(work, "lora", "--training.steps=30", "--training.lr=1e-2", "--checkpoint.every=30")
        losses = [r["loss"] for r in rows if "loss" in r]
        check(len(losses) == 30 and np.mean(losses[-5:]) < 0.95 * np.mean(losses[:5]),
              f"30 steps of LoRA chat fine-tuning on 4 ranks, ZeRO-3: loss {np.mean(losses[:5]):.3f} -> "
              f"{np.mean(losses[-5:]):.3f}")
        check("LoRA:" in out and "trainable parameters" in out, "the run says how many parameters train")
        check(f"training {os.path.join(work, 'base')} (llama: " in out,
              "the run names the checkpoint it starts from and the model's family")
        checkpoint = os.path.join(work, "lora", "checkpoints")
        adapter_bytes, base_bytes = folder_bytes(checkpoint), folder_bytes(os.path.join(work, "base"))
        check(adapter_bytes < base_bytes / 2,
              f"the checkpoint holds the adapters alone: {adapter_bytes} bytes against the base's {base_bytes}")

        # PEFT: the exported adapter on the base gives meshtrain's logits.
        adapter = os.path.join(work, "adapter")
        CHECKS.meshtrain("export", "peft", checkpoint, "--out", adapter)
        base = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        tuned = peft.PeftModel.from_pretrained(base, adapter).eval()
        tok = transformers.AutoTokenizer.from_pretrained(hf)
        prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            theirs = tuned(torch.tensor([prompt])).logits[0]
            untuned = tuned.get_base_model()
            with tuned.disable_adapter():
                plain = untuned(torch.tensor([prompt])).logits[0]
        ours = meshtrain_logits(work, checkpoint, prompt)
        diff, moved = (ours - theirs).abs().max().item(), (theirs - plain).abs().max().item()
        check(diff < 1e-4 and moved > 100 * diff,
              f"peft loads the exported adapter: its logits equal meshtrain's (max diff {diff:.2e}; the adapter moves "
              f"them by {moved:.3f})")
        # The adapter names the Hugging Face base it came from, so AutoPeftModelForCausalLM loads both.
        auto = peft.AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
        with torch.no_grad():
            alone = auto(torch.tensor([prompt])).logits[0]
        check((alone - theirs).abs().max().item() < 1e-5,
              "AutoPeftModelForCausalLM loads the exported adapter and its base by the name it records")

        # Merged: transformers alone gives the same.
        merged = os.path.join(work, "merged")
        CHECKS.meshtrain("export", "hf", checkpoint, "--out", merged)
        with torch.no_grad():
            alone = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()(torch.tensor([prompt])).logits[0]
        diff = (alone - theirs).abs().max().item()
        check(diff < 1e-4, f"the merged export in transformers equals peft's base + adapter (max diff {diff:.2e})")

        # generate --lora on the base: peft's greedy tokens.
        with torch.no_grad():
            greedy = tuned.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
        got = CHECKS.meshtrain("generate", "--checkpoint", os.path.join(work, "base"), "--lora", adapter,
                               "--prompt-ids", ",".join(map(str, prompt)), "--tokens", "10", "--temperature", "0")
        got = [int(t) for t in got.strip().split(",") if t]
        n = min(len(got), len(greedy))
        check(n > 0 and got[:n] == greedy[:n], f"generate --lora on the base equals peft's greedy tokens ({n} tokens)")

        # A broken adapter folder is refused by name; the good one serves.
        broken = os.path.join(work, "broken")
        shutil.copytree(adapter, broken)
        tensors = safetensors.torch.load_file(os.path.join(broken, "adapter_model.safetensors"))
        key = next(k for k in tensors if "q_proj.lora_B" in k)
        tensors[key] = tensors[key][:, :4].contiguous()
        safetensors.torch.save_file(tensors, os.path.join(broken, "adapter_model.safetensors"))
        r = subprocess.run([MESHTRAIN, "generate", "--checkpoint", os.path.join(work, "base"), "--lora", broken,
                            "--prompt", "x", "--tokens", "2"], capture_output=True, text=True)
        check(r.returncode != 0 and "q_proj" in r.stderr and "Traceback" not in r.stderr,
              "an adapter with a wrong shape is refused, naming it: " + r.stderr.strip().splitlines()[-1][:160])
        server = Server(MESHTRAIN, os.path.join(work, "base"), "--lora", adapter)
        try:
            answer = server.client().chat.completions.create(model="meshtrain", max_tokens=8, temperature=0,
                                                             messages=QUESTION)
            check(answer.choices[0].message.content is not None, "serve --lora answers a chat with the adapter merged")
            check(f"LoRA adapter {adapter} merged (rank 8, alpha 16, on " in "".join(server.banner),
                  "serve --lora says which adapter it merged")
        finally:
            check(server.stop() == 0, "and stops cleanly")
    CHECKS.finish()


if __name__ == "__main__":
    main()
