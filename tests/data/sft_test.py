"""Chat fine-tuning end to end, as the README shows it: a Hugging Face Llama
(tiny, random) with its Llama 3 shaped tokenizer and chat template is
imported; examples/sft/shakespeare_chat.jsonl is prepared as chat records;
4 ranks with ZeRO-3 fine-tune it from the imported weights
(checkpoint.init_from) with padded documents and the loss on the assistant's
tokens only; the result is exported to Hugging Face and served.

Checked against transformers: at learning rate 1e-12 the validation loss the
4 ranks report equals transformers' cross-entropy of the imported model over
the same documents, the same targets masked; with a learning rate the loss
falls; the export loads in transformers and its logits equal the checkpoint's
(`meshtrain generate` and transformers' greedy tokens agree); the server answers a chat.

usage: sft_test.py MESHTRAIN
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
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
CONTEXT = 96


def tokens(path):
    raw = open(path, "rb").read()
    width, count = int.from_bytes(raw[12:16], "little"), int.from_bytes(raw[16:24], "little")
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    return np.frombuffer(raw[32:], dtype=dtype, count=count).astype(np.int64)


def reference_loss(model, data, rows):
    """transformers' masked cross-entropy over the first `rows` documents, each cut at CONTEXT + 1."""
    ids, starts, mask = tokens(data + "/val.bin"), tokens(data + "/val.idx"), tokens(data + "/val.mask")
    total, counted = 0.0, 0
    for d in range(rows):
        begin, end = starts[d], min(starts[d + 1], starts[d] + CONTEXT + 1)
        x = torch.tensor(ids[begin:end - 1]).unsqueeze(0)
        y = torch.tensor(ids[begin + 1:end])
        keep = torch.tensor(mask[begin + 1:end]).bool()
        with torch.no_grad():
            logits = model(x).logits[0].double()
        losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        total += losses[keep].sum().item()
        counted += int(keep.sum())
    return total / counted


def train(work, name, *extra):
    args = [MESHTRAIN, "run", "-n", "4", "train", "--checkpoint.init_from=" + os.path.join(work, "base"),
            "--data.text=" + DATA, "--data.format=chat", "--data.packing=padded",
            "--data.tokenizer=" + os.path.join(work, "hf"), "--data.val_fraction=0.1", "--model.context=%d" % CONTEXT,
            "--parallel.zero_stage=3", "--training.batch=16", "--training.micro_batch=2", "--training.warmup=2",
            "--training.sample_tokens=0", "--training.eval_batches=2", "--run.out=" + os.path.join(work, name), *extra]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    rows = [json.loads(line) for line in open(os.path.join(work, name, "metrics.jsonl"))]
    return r.stdout, rows


def main():
    with tempfile.TemporaryDirectory(prefix="meshtrain-sft-") as work:
        hf = os.path.join(work, "hf")
        corpus = hf_fixtures.write_corpus(os.path.join(work, "corpus.txt"))
        with open(corpus, "a") as f:
            f.write(open(DATA).read())
        fast = hf_fixtures.llama3_tokenizer(corpus, hf)
        model = hf_fixtures.tiny_llama(hf, fast, context=256)
        CHECKS.meshtrain("import", "hf", hf, "--out", os.path.join(work, "base"))

        # Learning rate 1e-12 (no visible change): the 4 ranks' validation loss is the imported model's, masked as transformers computes it.
        out, rows = train(work, "frozen", "--training.steps=1", "--training.lr=1e-12", "--training.min_lr=0")
        val = [r["val_loss"] for r in rows if "val_loss" in r][-1]
        want = reference_loss(model, os.path.join(work, "frozen", "data"), rows=2 * 2 * 4)
        check(abs(val - want) < 1e-4 * want, f"ZeRO-3 on 4 ranks from the imported weights: validation loss {val:.6f} "
                                             f"equals transformers' masked loss {want:.6f}")
        check("fine-tuning from the weights of" in out and "count toward the loss" in out,
              "the run says where its weights came from and how many tokens count")

        # Fine-tuning: the loss falls.
        out, rows = train(work, "sft", "--training.steps=30", "--training.lr=3e-3", "--checkpoint.every=30")
        losses = [r["loss"] for r in rows if "loss" in r]
        check(len(losses) == 30 and np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]),
              f"30 steps of chat fine-tuning: loss {np.mean(losses[:5]):.3f} -> {np.mean(losses[-5:]):.3f}")
        checkpoint = os.path.join(work, "sft", "checkpoints")

        # Export: transformers loads it; greedy tokens agree with meshtrain generate.
        exported = os.path.join(work, "exported")
        CHECKS.meshtrain("export", "hf", checkpoint, "--out", exported)
        tuned = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
        tok = transformers.AutoTokenizer.from_pretrained(exported)
        prompt = tok.apply_chat_template([{"role": "user", "content": 'Who says "Friends, Romans"?'}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            theirs = tuned.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        ours = CHECKS.meshtrain("generate", "--checkpoint", checkpoint, "--prompt-ids",
                                ",".join(map(str, prompt)), "--tokens", "12", "--temperature", "0")
        ours = [int(t) for t in ours.strip().split(",") if t]
        n = min(len(ours), len(theirs))
        check(n > 0 and ours[:n] == theirs[:n],
              f"the export's greedy tokens in transformers equal meshtrain generate's ({n} tokens)")

        # Served with its chat template.
        server = Server(MESHTRAIN, checkpoint)
        try:
            answer = server.client().chat.completions.create(
                model="meshtrain", max_tokens=8, temperature=0,
                messages=[{"role": "user", "content": 'Who says "Friends, Romans"?'}])
            check(answer.choices[0].message.content is not None, "the server answers a chat with the fine-tuned model")
        finally:
            check(server.stop() == 0, "and stops cleanly")
    CHECKS.finish()


if __name__ == "__main__":
    main()
