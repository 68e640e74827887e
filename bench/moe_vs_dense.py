"""Mixture of experts against the dense model with the same active FLOPs, in one run.

Trains, one after the other and with the same data, steps, batch and schedule:
the dense `tiny` model (4 blocks, width 256, MLP hidden 1024) with data parallel,
and the same model whose blocks 1 and 3 are 8 experts of hidden 512 routed top-2
(two experts per token: the active FLOPs of the dense MLP) with expert parallel
(ep = ranks), optionally also top-1 experts of hidden 1024. Prints each run's final
validation loss, median tokens/s, parameters (total and active) and the MoE
layers' dropped share and load, then a markdown table.

    .venv/bin/python bench/moe_vs_dense.py [--text ../shared/data/tinyshakespeare.txt] [--steps 400] [--ranks 2]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")


def train(name, args, extra):
    out = os.path.join(args.out, name)
    command = [MESHTRAIN, "run", "-n", str(args.ranks), "train", "--model.preset=tiny", f"--data.text={args.text}",
               f"--training.steps={args.steps}", f"--training.batch={args.batch}",
               f"--training.micro_batch={args.batch // args.ranks}", "--training.eval_every=0",
               "--training.eval_batches=16", "--training.sample_tokens=0", "--checkpoint.every=0",
               "--checkpoint.keep=1", f"--run.out={out}"] + extra
    print("+", " ".join(command), flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:])
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.startswith('{"')]
    steps = [line for line in lines if "step" in line and "loss" in line]
    total = 0
    for text in done.stdout.splitlines():
        if "M parameters" in text:
            total = float(text.split("M parameters")[0].split()[-1].strip("(,"))
    last = steps[-1]
    row = {"name": name, "val_loss": last.get("val_loss"), "train_loss": last["loss"],
           "tokens_per_s": statistics.median(s["tokens_per_s"] for s in steps[len(steps) // 4:]),
           "parameters_m": total}
    if "moe" in last:
        row["dropped"] = statistics.mean(m["dropped"] for m in last["moe"])
        row["load"] = max(m["load_max_over_mean"] for m in last["moe"])
    print(json.dumps(row), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--top1", action="store_true", help="also 8 experts of hidden 1024, top-1 (Switch)")
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="moe-vs-dense-"))
    args = parser.parse_args()
    moe = ["--model.moe_experts=8", "--model.moe_every=2", f"--parallel.ep={args.ranks}"]
    rows = [train("dense", args, []),
            train("moe-8x512-top2", args, moe + ["--model.moe_top_k=2", "--model.moe_hidden=512"])]
    if args.top1:
        rows.append(train("moe-8x1024-top1", args, moe + ["--model.moe_top_k=1", "--model.moe_hidden=1024"]))
    print(f"\n{args.steps} steps x {args.batch} x 128 tokens on {args.ranks} ranks, {os.path.basename(args.text)}")
    print("| model | parameters | val loss | train loss | tokens/s | dropped | load (max/mean) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        dropped = f"{100 * r['dropped']:.1f}%" if "dropped" in r else "-"
        load = f"{r['load']:.2f}" if "load" in r else "-"
        print(f"| {r['name']} | {r['parameters_m']:.2f}M | {r['val_loss']:.4f} | {r['train_loss']:.4f} | "
              f"{r['tokens_per_s']:,.0f} | {dropped} | {load} |")


if __name__ == "__main__":
    main()
