"""Training throughput of meshtrain against PyTorch doing the same work, in one run.

For each model preset and rank count, runs `meshtrain bench train` and
bench/reference/train_gpt.py (single process, or DDP over gloo through
torch.distributed.run) alternately, with the same threads per rank, the same
environment, the same global batch, micro-batch, optimizer and schedule, and
prints median tokens/s of each, their ratio (each round's own ratio in the JSON
line: bench/train_side_by_side.py when they spread), meshtrain's MFU against the
measured matmul peak of the run's dtype, and the share of all-reduce time hidden behind
backward: 1 - (time a rank waits for its all-reduces after the last rank's
backward ended) / (the same all-reduces timed alone); the wait for the slowest
rank's backward (skew) is reported apart. Run from the repository root with the project's virtual environment:

    .venv/bin/python bench/train_vs_pytorch.py [--presets tiny small] [--ranks 1 2] [--repeats 3]
        [--moe-experts 8 --moe-top-k 2 --moe-hidden 768]   # mixture-of-experts blocks (dropless, every block)
        [--dtype bfloat16]      # both sides under bf16 autocast
        [--compile]             # also PyTorch with torch.compile (inductor), one process
        [--unfused]             # also meshtrain with model.fused = false
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")
REFERENCE = os.path.join(ROOT, "bench", "reference", "train_gpt.py")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_json(output):
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no JSON line in output:\n" + output)


def run(command, env):
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}")
    return last_json(done.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per side; medians are reported")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8, help="per rank, per forward/backward")
    parser.add_argument("--moe-experts", type=int, default=0, help="MoE in every block: experts (0: dense)")
    parser.add_argument("--moe-top-k", type=int, default=1)
    parser.add_argument("--moe-hidden", type=int, default=0, help="an expert's hidden size (0: 4 x width)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compile", action="store_true", help="also torch.compile'd PyTorch (1 rank)")
    parser.add_argument("--unfused", action="store_true", help="also meshtrain with model.fused = false")
    args = parser.parse_args()
    ours_moe, theirs_moe = [], []
    if args.moe_experts:
        ours_moe = [f"--model.moe_experts={args.moe_experts}", f"--model.moe_top_k={args.moe_top_k}",
                    "--model.moe_every=1", "--model.moe_capacity_factor=0", "--model.moe_second_expert=always"]
        theirs_moe = ["--moe-experts", str(args.moe_experts), "--moe-top-k", str(args.moe_top_k), "--moe-every", "1",
                      "--moe-capacity-factor", "0", "--moe-second-expert", "always"]
        if args.moe_hidden:
            ours_moe.append(f"--model.moe_hidden={args.moe_hidden}")
            theirs_moe += ["--moe-hidden", str(args.moe_hidden)]

    cores = os.cpu_count()
    rows = []
    for preset in args.presets:
        for ranks in args.ranks:
            env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // ranks)))
            ours_cmd = [MESHTRAIN, "run", "-n", str(ranks), "bench", "train", "--steps", str(args.steps),
                        f"--model.preset={preset}", f"--training.batch={args.batch}", f"--training.dtype={args.dtype}",
                        f"--training.micro_batch={args.micro_batch}", "--run.out=runs/bench-train"] + ours_moe
            theirs_base = [sys.executable, REFERENCE]
            if ranks > 1:
                theirs_base = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                               "--master_addr=127.0.0.1", None, REFERENCE]
            theirs_base += ["--preset", preset, "--batch", str(args.batch), "--micro-batch", str(args.micro_batch),
                            "--steps", str(args.steps), "--dtype", args.dtype] + theirs_moe
            # Each variant once per round, rounds alternating: medians over rounds.
            variants = {"meshtrain": ours_cmd, "pytorch": theirs_base}
            if args.unfused:
                variants["meshtrain_unfused"] = ours_cmd + ["--model.fused=false"]
            if args.compile and ranks == 1:
                variants["pytorch_compile"] = theirs_base + ["--compile", "--warmup-steps", "4"]
            results = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, command in variants.items():
                    command = [f"--master_port={free_port()}" if c is None else c for c in command]
                    results[name].append(run(command, env))
            ours, theirs = results["meshtrain"], results["pytorch"]
            tps = {name: statistics.median(r["tokens_per_s"] for r in rows_) for name, rows_ in results.items()}
            ours_tps, theirs_tps = tps["meshtrain"], tps["pytorch"]
            mfu = statistics.median(r["mfu"] for r in ours)
            rows.append({
                "preset": preset, "ranks": ranks, "dtype": args.dtype, "threads_per_rank": ours[0]["threads"],
                "meshtrain_tokens_per_s": ours_tps, "pytorch_tokens_per_s": theirs_tps, "ratio": ours_tps / theirs_tps,
                # Each round's own ratio (its runs a minute apart), for the spread the medians hide.
                "round_ratios": [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)],
                "meshtrain_unfused_tokens_per_s": tps.get("meshtrain_unfused"),
                "pytorch_compile_tokens_per_s": tps.get("pytorch_compile"),
                "ratio_vs_compile": ours_tps / tps["pytorch_compile"] if "pytorch_compile" in tps else None,
                "meshtrain_mfu": mfu, "pytorch_mfu": mfu * theirs_tps / ours_tps,
                "matmul_peak_gflops_per_rank": statistics.median(r["matmul_peak_gflops_per_rank"] for r in ours),
                "meshtrain_counted_peak_mib": statistics.median(max(r["counted_peak_mib"]) for r in ours),
                "meshtrain_peak_rss_mib": statistics.median(max(r["peak_rss_mib"]) for r in ours),
                "pytorch_peak_rss_mib": statistics.median(max(r["peak_rss_mib"]) for r in theirs),
                "meshtrain_rss_growth_mib": statistics.median(max(r["rss_growth_mib"]) for r in ours),
                "pytorch_rss_growth_mib": statistics.median(max(r["rss_growth_mib"]) for r in theirs),
                "hidden_fraction": statistics.median(r["hidden_fraction"] for r in ours) if ranks > 1 else None,
                "allreduce_ms_per_step": 1e3 * statistics.median(r["allreduce_s_per_step"] for r in ours),
                "exposed_ms_per_step": 1e3 * statistics.median(r["exposed_wait_s_per_step"] for r in ours),
                "skew_ms_per_step": 1e3 * statistics.median(r["skew_wait_s_per_step"] for r in ours),
            })
            row = rows[-1]
            print(json.dumps(row), flush=True)

    print(f"\nmeshtrain vs PyTorch {theirs[0]['torch']} ({args.dtype}): global batch {args.batch}, micro-batch {args.micro_batch}, "
          f"{args.steps} timed steps, medians of {args.repeats} alternating runs; OMP_NUM_THREADS = {cores} cores / ranks; "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}")
    print(f"{'model':8} {'ranks':>5} {'meshtrain tok/s':>16} {'pytorch tok/s':>14} {'ratio':>6} {'compile tok/s':>14} "
          f"{'ratio':>6} {'unfused tok/s':>14} {'MFU':>6} "
          f"{'pt MFU':>7} {'hidden':>7} {'allreduce ms':>13} {'exposed ms':>11} {'skew ms':>8}")
    for r in rows:
        hidden = f"{100 * r['hidden_fraction']:.0f}%" if r["hidden_fraction"] is not None else "-"
        optional = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
        print(f"{r['preset']:8} {r['ranks']:>5} {r['meshtrain_tokens_per_s']:>16.0f} {r['pytorch_tokens_per_s']:>14.0f} "
              f"{r['ratio']:>6.3f} {optional(r['pytorch_compile_tokens_per_s'], '>14.0f')} "
              f"{optional(r['ratio_vs_compile'], '>6.3f')} {optional(r['meshtrain_unfused_tokens_per_s'], '>14.0f')} "
              f"{100 * r['meshtrain_mfu']:>5.1f}% {100 * r['pytorch_mfu']:>6.1f}% {hidden:>7} "
              f"{r['allreduce_ms_per_step']:>13.1f} {r['exposed_ms_per_step']:>11.1f} {r['skew_ms_per_step']:>8.1f}")


if __name__ == "__main__":
    main()
