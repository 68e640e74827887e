"""Training on one GPU: meshtrain against PyTorch eager and torch.compile, same session.

For each model preset, runs `meshtrain bench train` on cuda:0 and
bench/reference/train_gpt.py twice (eager, then torch.compile'd) with the same
model, global batch, optimizer, dtype (bfloat16 autocast by default) and number
of steps, and prints median tokens/s of each side, meshtrain's ratio to each,
and MFU against the bfloat16 matmul peak meshtrain measured on the same GPU
(an 8192^3 product) and against the data-sheet dense peak given with --spec-tflops.
GPT-2 presets and the Llama 3.2 shapes (llama3.2-1b: RMSNorm, RoPE, grouped
keys and values, SwiGLU, its 128,256-token vocabulary) are on both sides; the
two sides' parameter counts must agree. A preset may carry its own batch and
context, PRESET:BATCHxCONTEXT (llama3.2-1b:8x2048).

    python3 bench/gpu_train_vs_pytorch.py [--presets gpt2-124m llama3.2-1b:8x2048] [--batch 16] [--markdown FILE]
    # the script's own check on a CPU, a cut-down Llama:
    python3 bench/gpu_train_vs_pytorch.py --device cpu --dtype float32 --presets llama3.2-1b:2x128 \
        --layers 2 --steps 2 --no-compile --largest '' --graph
"""
import argparse
import json
import os
import random
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(ROOT, "bench", "reference", "train_gpt.py")


def last_json(output):
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no JSON line in output:\n" + output[-4000:])


def run(command):
    print("+", " ".join(command), flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-4000:]}")
    return last_json(done.stdout)


def write_tokens(path, count, vocab, seed):
    """A meshtrain token file (see meshtrain/train/data.h) of uniform random tokens, as the reference draws."""
    rng = random.Random(seed)
    wide = vocab > 65536  # Llama 3's 128,256 ids take 4 bytes
    with open(path, "wb") as f:
        f.write(b"MTTOKENS" + struct.pack("<IIQQ", 1, 4 if wide else 2, count, vocab))
        f.write(struct.pack(f"<{count}{'I' if wide else 'H'}", *(rng.randrange(vocab) for _ in range(count))))


def parse_preset(text, batch):
    """PRESET or PRESET:BATCHxCONTEXT -> (preset, batch, context or 0: the preset's; a Llama's 131,072 is cut
    to 2,048)."""
    name, _, shape = text.partition(":")
    if not shape:
        return name, batch, 2048 if name.startswith("llama") else 0
    sequences, _, context = shape.partition("x")
    return name, int(sequences), int(context)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshtrain", default=os.path.join(ROOT, "build", "bin", "meshtrain"))
    parser.add_argument("--presets", nargs="*", default=["gpt2-124m", "gpt2-350m", "llama3.2-1b:8x2048"],
                        help="PRESET or PRESET:BATCHxCONTEXT")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (one micro-batch)")
    parser.add_argument("--layers", type=int, default=0, help="cut every preset to this many blocks (0: as it is)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the script's own check")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (after 3 untimed)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--spec-tflops", type=float, default=989.0, help="data-sheet dense peak of the dtype")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-gpu"))
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile side")
    parser.add_argument("--largest", default="48,2560,20",
                        help="layers,width,heads of a large model trained for two steps in float32 with activation "
                             "checkpointing, its peak GPU memory set against the planner's prediction ('' skips it)")
    parser.add_argument("--graph", nargs="*", default=["small:64", "gpt2-124m:16"],
                        help="preset:batch pairs for `meshtrain bench graph` (the step captured as a CUDA graph "
                             "against the same step run eagerly)")
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    token_files = {}

    def tokens_for(vocab):
        if vocab not in token_files:
            train, val = (os.path.join(args.out, f"{name}-{vocab}.bin") for name in ("train", "val"))
            write_tokens(train, 1 << 21, vocab, 1)
            write_tokens(val, 1 << 16, vocab, 2)
            token_files[vocab] = (train, val)
        return token_files[vocab]

    train_file, val_file = tokens_for(50257)
    rows = []
    for text in args.presets:
        preset, batch, context = parse_preset(text, args.batch)
        vocab = 128256 if preset.startswith("llama3") else 50257
        train, val = tokens_for(vocab)
        shape = ([f"--model.context={context}"] if context else []) + \
            ([f"--model.layers={args.layers}"] if args.layers else [])
        ours = run([args.meshtrain, "bench", "train", "--warmup-steps", "3", "--steps", str(args.steps),
                    f"--model.preset={preset}", f"--training.batch={batch}",
                    f"--training.micro_batch={batch}", f"--training.dtype={args.dtype}", f"--run.device={args.device}",
                    f"--data.train_file={train}", f"--data.val_file={val}", f"--run.out={args.out}",
                    "--model.dropout=0"] + shape)
        reference = [sys.executable, REFERENCE, "--preset", preset, "--batch", str(batch), "--micro-batch",
                     str(batch), "--steps", str(args.steps), "--warmup-steps", "3", "--device", args.device,
                     "--dtype", args.dtype] + (["--context", str(context)] if context else []) + \
            (["--layers", str(args.layers)] if args.layers else [])
        counted = run(reference + ["--count-parameters"])["parameters"]  # before any timed run
        if counted != ours["parameters"]:
            raise RuntimeError(f"{preset}: the reference has {counted:,} parameters, meshtrain "
                               f"{ours['parameters']:,}: not the same model")
        eager = run(reference)
        compiled = None if args.no_compile else run(reference + ["--compile"])
        peak = ours["matmul_peak_gflops_per_rank"] * 1e9
        mfu = ours["mfu"]  # against the measured peak
        flops_per_token = mfu * peak / ours["tokens_per_s"]
        row = {"preset": preset, "parameters": ours["parameters"], "batch": batch, "dtype": args.dtype,
               "context": ours["context"],
               "meshtrain_tokens_per_s": ours["tokens_per_s"], "eager_tokens_per_s": eager["tokens_per_s"],
               "compile_tokens_per_s": compiled["tokens_per_s"] if compiled else None,
               "measured_peak_tflops": peak / 1e12, "flops_per_token": flops_per_token,
               "meshtrain_device_peak_mib": ours["device_peak_mib"][0], "eager_device_peak_mib": eager["device_peak_mib"],
               "compile_device_peak_mib": compiled["device_peak_mib"] if compiled else None, "torch": eager["torch"]}
        rows.append(row)
        print(json.dumps(row), flush=True)

    def mfu(tokens, peak_flops):
        return f"{100 * tokens * row['flops_per_token'] / peak_flops:.1f}%" if tokens else "-"

    lines = [f"| model, batch x tokens | side | tokens/s | meshtrain ÷ side | MFU (measured {rows[0]['measured_peak_tflops']:.0f} TFLOP/s) "
             f"| MFU ({args.spec_tflops:.0f} TFLOP/s spec) | peak GPU memory (MiB) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"] if rows else []
    for row in rows:
        ours = row["meshtrain_tokens_per_s"]
        for side, key, memory in (("meshtrain", "meshtrain_tokens_per_s", "meshtrain_device_peak_mib"),
                                  ("PyTorch eager", "eager_tokens_per_s", "eager_device_peak_mib"),
                                  ("torch.compile", "compile_tokens_per_s", "compile_device_peak_mib")):
            tokens = row[key]
            if tokens is None:
                continue
            lines.append(f"| {row['preset']}, {row['batch']} x {row['context']} | {side} | {tokens:,.0f} | {ours / tokens:.3f} | "
                         f"{mfu(tokens, row['measured_peak_tflops'] * 1e12)} | {mfu(tokens, args.spec_tflops * 1e12)} | "
                         f"{row[memory]:,.0f} |")
    if args.largest:
        layers, width, heads = (int(x) for x in args.largest.split(","))
        big = run([args.meshtrain, "bench", "train", "--warmup-steps", "1", "--steps", "2", "--model.preset=gpt2-1.5b",
                   f"--model.layers={layers}", f"--model.width={width}", f"--model.heads={heads}",
                   "--training.batch=4", "--training.micro_batch=4", "--parallel.activation_checkpoint=full",
                   "--run.device=cuda", f"--data.train_file={train_file}", f"--data.val_file={val_file}",
                   f"--run.out={args.out}", "--model.dropout=0"])
        measured, planned = big["device_peak_mib"][0], big["planned_peak_mib"][0]
        lines.append("")
        lines.append(f"Large model on the one GPU: {big['parameters'] / 1e9:.2f}B parameters ({layers} layers, width {width}), "
                     f"float32 AdamW (16 bytes per parameter), activation checkpointing, batch 4 x 1024: "
                     f"{big['tokens_per_s']:,.0f} tokens/s, peak GPU memory {measured:,.0f} MiB measured vs "
                     f"{planned:,.0f} MiB planned ({100 * (planned - measured) / measured:+.1f}%).")
    if args.graph:
        lines += ["", "| model | batch | eager tokens/s | CUDA graph tokens/s | speed-up | largest loss difference |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for pair in args.graph:
        preset, batch = pair.split(":")
        data = [f"--data.train_file={train_file}", f"--data.val_file={val_file}"] if preset.startswith("gpt2") else []
        g = run([args.meshtrain, "bench", "graph", f"--model.preset={preset}", f"--training.batch={batch}",
                 f"--training.micro_batch={batch}", f"--training.dtype={args.dtype}", "--model.dropout=0",
                 f"--run.out={args.out}"] + data)
        lines.append(f"| {preset} | {batch} | {g['eager_tokens_per_s']:,.0f} | {g['graph_tokens_per_s']:,.0f} | "
                     f"{g['speedup']:.3f} | {g['largest_relative_loss_difference']:.1e} |")
    table = "\n".join(lines)
    note = (f"\n{args.dtype}{' autocast' if args.dtype == 'bfloat16' else ''}, {args.steps} timed steps (median step), "
            f"torch {rows[0]['torch']}, AdamW, clipping at 1.0") if rows else ""
    print("\n" + table + note)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + note + "\n")


if __name__ == "__main__":
    main()
