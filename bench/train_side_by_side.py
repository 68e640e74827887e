"""Training throughput of meshtrain against PyTorch with both running at the
same time, each pinned to its own core with one thread, so that the machine's
drift (on a shared virtual machine, the speed of a fixed matmul moves by up to
a fifth from one second to the next) falls on both alike. The cores swap every
round; each round's ratio is taken from the two runs that overlapped in time.

bench/train_vs_pytorch.py measures the configuration the goals name (all cores
to one side at a time, sides alternating); this one answers "which is faster"
when that comparison drowns in drift. One process a side, float32 or bfloat16
autocast, the same model, batch, micro-batch, optimizer and schedule as there.
Run from the repository root with the project's virtual environment:

    .venv/bin/python bench/train_side_by_side.py [--preset small] [--dtype float32] [--rounds 4] [--steps 8]
"""
import argparse
import math
import os
import statistics
import subprocess
import sys

from train_vs_pytorch import MESHTRAIN, REFERENCE, last_json


def start(command, core):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))


def finish(process, command):
    output, _ = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{output}")
    return last_json(output)["tokens_per_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=4, help="concurrent runs; the cores swap every round")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("train_side_by_side.py needs two cores (one per side); this process may use " + str(len(cores)))
    ours = [MESHTRAIN, "bench", "train", "--steps", str(args.steps), f"--model.preset={args.preset}",
            f"--training.batch={args.batch}", f"--training.dtype={args.dtype}",
            f"--training.micro_batch={args.micro_batch}", "--run.out=runs/bench-side-by-side"]
    theirs = [sys.executable, REFERENCE, "--preset", args.preset, "--batch", str(args.batch), "--micro-batch",
              str(args.micro_batch), "--steps", str(args.steps), "--dtype", args.dtype]
    ratios = []
    print(f"{args.preset}, {args.dtype}, batch {args.batch}, micro-batch {args.micro_batch}, {args.steps} timed steps, "
          f"one thread each, side by side on cores {cores[0]} and {cores[1]}")
    print(f"{'round':>5} {'meshtrain core':>14} {'meshtrain tok/s':>16} {'pytorch tok/s':>14} {'ratio':>6}")
    for r in range(args.rounds):
        ours_core, theirs_core = (cores[0], cores[1]) if r % 2 == 0 else (cores[1], cores[0])
        a, b = start(theirs, theirs_core), start(ours, ours_core)  # PyTorch first: its import takes longer
        theirs_tps, ours_tps = finish(a, theirs), finish(b, ours)
        ratios.append(ours_tps / theirs_tps)
        print(f"{r:>5} {ours_core:>14} {ours_tps:>16.0f} {theirs_tps:>14.0f} {ratios[-1]:>6.3f}", flush=True)
    geomean = math.exp(statistics.mean(math.log(x) for x in ratios))
    print(f"ratio: median {statistics.median(ratios):.3f}, geometric mean {geomean:.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds")


if __name__ == "__main__":
    main()
