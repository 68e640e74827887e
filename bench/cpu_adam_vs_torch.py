"""The fused CPU AdamW of meshtrain's offloaded optimizer against PyTorch's own
CPU AdamW, on the same sizes and threads, in one run.

meshtrain's numbers come from `meshtrain bench offload --parts adam` (its fused
kernel and libtorch's torch::optim::AdamW, the C++ twin of PyTorch's
single-tensor loop); PyTorch's from torch.optim.AdamW with foreach=False (the
single-tensor loop), foreach=True and fused=True, each on one flat tensor and
on the same elements as 64 tensors. Medians of --trials steps. Run from the
repository root with the project's virtual environment:

    .venv/bin/python bench/cpu_adam_vs_torch.py [--threads 2] [--trials 7]
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")


def torch_step_ms(numel, pieces, trials, **kind):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(p.clone()) for p in torch.randn(numel).chunk(pieces)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    adamw = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **kind)
    adamw.step()  # states allocated outside the timing
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        adamw.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trials", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run([MESHTRAIN, "bench", "offload", "--parts", "adam", "--trials", str(args.trials)],
                         env=env, check=True, capture_output=True, text=True).stdout
    ours = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    print(f"threads {args.threads}, torch {torch.__version__}, meshtrain kernel {ours[0]['kernel']}; "
          "milliseconds per step (median), speedup of the fused kernel")
    print("| elements | meshtrain fused | + bf16 copy | libtorch AdamW | torch foreach=False | torch foreach=True "
          "| torch fused=True | vs foreach=False | vs foreach | vs fused |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in ours:
        n = row["elements"]
        single = torch_step_ms(n, 1, args.trials, foreach=False)
        single64 = torch_step_ms(n, 64, args.trials, foreach=False)
        foreach = torch_step_ms(n, 64, args.trials, foreach=True)
        fused = torch_step_ms(n, 64, args.trials, fused=True)
        f = row["fused_ms"]
        print(f"| {n / 2**20:.0f}M | {f:.2f} | {row['fused_bf16_copy_ms']:.2f} | {row['torch_adamw_ms']:.2f} "
              f"| {single:.2f} (64 tensors: {single64:.2f}) | {foreach:.2f} | {fused:.2f} "
              f"| {single / f:.1f}x ({single64 / f:.1f}x) | {foreach / f:.1f}x | {fused / f:.1f}x |")


if __name__ == "__main__":
    main()
