"""What packing buys on a corpus of short documents: the share of each row that
is padding under data.packing = "padded" (one document per row) against
"packed" (documents side by side, attention kept inside each), and the
tokens/s that count toward the loss in each, training the same model on the
same data, threads and steps. "concat" (documents side by side, attention
across them) is the control: packed rows should train as fast.

The corpus is tiny Shakespeare cut into paragraphs (about 160 bytes, far
shorter than the context), as JSON Lines, with the byte tokenizer.

usage: packing_gain.py MESHTRAIN [--context 256] [--steps 20] [--repeats 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "..", "shared", "data", "tinyshakespeare.txt")


def tokens(path):
    raw = open(path, "rb").read()
    width, count = int.from_bytes(raw[12:16], "little"), int.from_bytes(raw[16:24], "little")
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    return np.frombuffer(raw[32:], dtype=dtype, count=count).astype(np.int64)


def run(meshtrain, data, packing, a, work):
    out = os.path.join(work, f"run-{packing}-{len(os.listdir(work))}")
    subprocess.run([meshtrain, "train", f"--data.train_file={data}/train.bin", f"--data.val_file={data}/val.bin",
                    f"--data.packing={packing}", "--model.preset=tiny", f"--model.context={a.context}",
                    f"--training.steps={a.steps}", "--training.batch=16", "--training.micro_batch=8",
                    "--training.eval_every=0", "--training.eval_batches=1", "--training.sample_tokens=0",
                    "--checkpoint.every=0", f"--run.out={out}"], check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in line]
    return statistics.median(r["tokens_per_s"] for r in rows[2:])  # past the first steps' warm-up


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("meshtrain")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    a = parser.parse_args()
    paragraphs = [p for p in open(CORPUS, encoding="utf-8").read().split("\n\n") if p.strip()]
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-packing-") as work:
        source = os.path.join(work, "docs.jsonl")
        with open(source, "w") as f:
            for p in paragraphs:
                f.write(json.dumps({"text": p + "\n"}) + "\n")
        data = os.path.join(work, "data")
        subprocess.run([a.meshtrain, "prepare", source, "--out", data], check=True, capture_output=True)
        starts = tokens(os.path.join(data, "train.idx"))
        lengths = np.diff(starts)
        # Padded: a row is one document cut at context + 1; its targets are min(len, context + 1) - 1 of context.
        padded_counted = np.minimum(lengths, a.context + 1) - 1
        padded_share = padded_counted.mean() / a.context
        # Packed: every target but the one at each document's end counts.
        packed_share = 1 - len(lengths) / starts[-1]
        speeds = {p: [] for p in ("padded", "packed", "concat")}
        for _ in range(a.repeats):
            for p in speeds:
                speeds[p].append(run(a.meshtrain, data, p, a, work))
        med = {p: statistics.median(v) for p, v in speeds.items()}
        print(f"{len(lengths)} documents, median {int(np.median(lengths))} tokens, context {a.context}")
        print(f"padded: {padded_share:.1%} of targets count, {med['padded']:,.0f} tokens/s, "
              f"{med['padded'] * padded_share:,.0f} counted tokens/s")
        print(f"packed: {packed_share:.1%} of targets count, {med['packed']:,.0f} tokens/s, "
              f"{med['packed'] * packed_share:,.0f} counted tokens/s")
        print(f"concat: {med['concat']:,.0f} tokens/s (packed {med['packed'] / med['concat']:.2f}x)")
        print(f"packing removes {1 - padded_share:.1%} padding; counted tokens/s "
              f"{med['packed'] * packed_share / (med['padded'] * padded_share):.2f}x padded (medians of {a.repeats})")


if __name__ == "__main__":
    main()
