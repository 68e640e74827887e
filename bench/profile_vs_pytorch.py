"""Where one training step's time goes, operator by operator, for meshtrain and
PyTorch doing the same work: runs `meshtrain bench train --profile` and
bench/reference/train_gpt.py --profile (libtorch's profiler on both sides; a
Chrome trace each, for chrome://tracing or ui.perfetto.dev), then prints each
side's self time per step by category and its largest operators, and on the
CPU each side's matrix products by operand sizes with their GFLOP/s; on a GPU
each side's kernels by time on the device. Run from the repository root with
the project's virtual environment:

    .venv/bin/python bench/profile_vs_pytorch.py [--preset small] [--dtype bfloat16] [--out runs/profile]
    python3 bench/profile_vs_pytorch.py --device cuda --preset llama3.2-1b --context 2048 --batch 8 --micro-batch 8
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")
REFERENCE = os.path.join(ROOT, "bench", "reference", "train_gpt.py")

CATEGORIES = [  # first match wins; the dense GPT's only batched matmuls are its attention's
    ("attention", ("scaled_dot_product", "fused_attention", "aten::bmm")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear")),
    ("casts and copies", ("aten::copy_", "aten::_to_copy", "aten::to", "ToCopyBackward")),
    ("norms", ("layer_norm", "add_norm", "aten::rsqrt", "aten::pow", "aten::mean")),
    ("activations", ("gelu", "silu", "swiglu", "aten::tanh")),
    ("cross-entropy", ("log_softmax", "nll_loss", "cross_entropy")),
    ("optimizer", ("adam", "cpu_adamw", "Optimizer", "aten::lerp", "aten::addcdiv", "aten::addcmul", "aten::sqrt", "_foreach")),
    ("adds, fills, sums", ("aten::add", "aten::fill_", "aten::zero_", "aten::sum", "aten::mul", "aten::div")),
]


def category(name):
    for label, keys in CATEGORIES:
        if any(k in name for k in keys):
            return label
    return "other (views, allocation, autograd)"


def summarise(path):
    with open(path) as f:
        ops = json.load(f)
    totals = {}
    for op in ops:
        totals[category(op["name"])] = totals.get(category(op["name"]), 0.0) + op["self_ms_per_step"]
    return ops, totals


def print_products(args, sides):
    """Each side's matrix products by operand sizes: the same ATen products at
    the same speed, or not. PyTorch's attention (one SDPA kernel) is not among them."""
    for side, path in sides:
        if not os.path.exists(path):
            print(f"\n{side}: no {path}")
            continue
        with open(path) as f:
            products = json.load(f)
        ms = sum(p["ms_per_step"] for p in products)
        gflop = sum(p["gflop_per_step"] for p in products)
        print(f"\n{side}: matrix products {ms:.1f} ms per step, {gflop:.1f} GFLOP, {gflop / ms * 1e3 if ms else 0:.0f} "
              f"GFLOP/s; the longest")
        for p in products[:args.top]:
            print(f"  {p['name'][6:]:8} {p['operands'][:40]:40} {p['calls_per_step']:>5.0f} calls {p['ms_per_step']:>8.1f} ms "
                  f"{p['gflops']:>6.0f} GFLOP/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--context", type=int, default=0, help="tokens per sequence (0: the preset's)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--meshtrain", default=MESHTRAIN)
    parser.add_argument("--out", default="runs/profile")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count())))
    ours_dir, theirs_dir = os.path.join(args.out, "meshtrain"), os.path.join(args.out, "pytorch")
    context = [f"--model.context={args.context}"] if args.context else []
    if args.preset.startswith(("gpt2", "llama3")):  # the GPU benchmark's random tokens: nothing to download
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_train_vs_pytorch import write_tokens
        vocab = 128256 if args.preset.startswith("llama3") else 50257
        os.makedirs(args.out, exist_ok=True)
        for name, seed in (("train", 1), ("val", 2)):
            write_tokens(os.path.join(args.out, f"{name}.bin"), 1 << 20, vocab, seed)
        context += [f"--data.train_file={args.out}/train.bin", f"--data.val_file={args.out}/val.bin"]
    subprocess.run([args.meshtrain, "bench", "train", "--steps", "2", "--profile", ours_dir, "--profile-steps",
                    str(args.steps), f"--model.preset={args.preset}", f"--training.dtype={args.dtype}",
                    f"--training.batch={args.batch}", f"--training.micro_batch={args.micro_batch}",
                    f"--run.device={args.device}", "--model.dropout=0", f"--run.out={args.out}/run"] + context,
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([sys.executable, REFERENCE, "--preset", args.preset, "--dtype", args.dtype, "--batch", str(args.batch),
                    "--micro-batch", str(args.micro_batch), "--steps", "2", "--profile", theirs_dir, "--profile-steps",
                    str(args.steps), "--device", args.device] + (["--context", str(args.context)] if args.context else []),
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ours, ours_totals = summarise(os.path.join(ours_dir, "ops.json"))
    theirs, theirs_totals = summarise(os.path.join(theirs_dir, "ops.json"))
    print(f"{args.preset}, {args.dtype}, batch {args.batch}, micro-batch {args.micro_batch}, "
          f"{env['OMP_NUM_THREADS']} threads: self time per step (ms), {args.steps} profiled steps")
    print(f"{'category':40} {'meshtrain':>10} {'pytorch':>10}")
    labels = [label for label, _ in CATEGORIES] + ["other (views, allocation, autograd)"]
    for label in labels:
        print(f"{label:40} {ours_totals.get(label, 0):>10.1f} {theirs_totals.get(label, 0):>10.1f}")
    print(f"{'all operators':40} {sum(ours_totals.values()):>10.1f} {sum(theirs_totals.values()):>10.1f}")
    for side, ops in (("meshtrain", ours), ("pytorch", theirs)):
        print(f"\n{side}: largest operators")
        for op in ops[:args.top]:
            print(f"  {op['name'][:62]:62} {op['calls_per_step']:>6.0f} calls {op['self_ms_per_step']:>9.1f} ms")
    if args.device == "cpu":
        print_products(args, ((side, os.path.join(d, "products.json")) for side, d in
                              (("meshtrain", ours_dir), ("pytorch", theirs_dir))))
    if args.device == "cuda":
        for side, directory in (("meshtrain", ours_dir), ("pytorch", theirs_dir)):
            if not os.path.exists(os.path.join(directory, "kernels.json")):
                print(f"\n{side}: the profiler recorded no GPU activity (no {directory}/kernels.json)")
                continue
            with open(os.path.join(directory, "kernels.json")) as f:
                kernels = json.load(f)
            print(f"\n{side}: {sum(k['self_ms_per_step'] for k in kernels):.1f} ms of GPU work per step, "
                  f"{sum(k['calls_per_step'] for k in kernels):.0f} kernels, copies and fills; the largest")
            for k in kernels[:args.top]:
                print(f"  {k['name'][:90]:90} {k['calls_per_step']:>6.0f} calls {k['self_ms_per_step']:>9.2f} ms")
    print(f"\nChrome traces: {ours_dir}/trace.json, {theirs_dir}/trace.json")


if __name__ == "__main__":
    main()
