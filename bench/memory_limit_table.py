"""The largest `tiny`-family model (width 256, 4 heads, context 128; more
blocks) that each ZeRO stage trains under a fixed per-rank memory limit.

For each stage, binary-searches the block count: a size fits when
`meshtrain train` with memory.limit_mb runs its steps (the counting allocator
fails any allocation beyond the limit, naming the phase) and does not fit when
it exits with the out-of-memory error. Prints the largest fitting size per
stage, its parameter count and the predicted model states. Run from the
repository root:

    .venv/bin/python bench/memory_limit_table.py [--ranks 4] [--limit-mb 64]
"""
import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")


def parameters(layers, width=256, vocab=256, context=128):
    block = 12 * width * width + 13 * width  # qkv, proj, fc, proj weights and biases, two layer norms
    return layers * block + vocab * width + context * width + 2 * width


def fits(stage, layers, args, data):
    command = [MESHTRAIN, "run", "-n", str(args.ranks), "train", "--model.preset=tiny", f"--model.layers={layers}",
               f"--parallel.zero_stage={stage}", f"--memory.limit_mb={args.limit_mb}", "--training.steps=2",
               f"--training.batch={args.ranks}", "--training.micro_batch=1", "--training.sample_tokens=0",
               "--training.eval_batches=1", "--checkpoint.every=0", f"--data.train_file={data}/train.bin",
               f"--data.val_file={data}/val.bin", f"--run.out={data}/run-{stage}-{layers}", "--checkpoint.resume=false"]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode == 0:
        return True
    if "out of memory on rank" in done.stdout:
        return False
    raise RuntimeError(f"{' '.join(command)} failed for another reason:\n{done.stdout[-3000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--limit-mb", type=int, default=64)
    parser.add_argument("--max-layers", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        subprocess.run([MESHTRAIN, "prepare", "/usr/share/common-licenses", "--out", data], check=True,
                       stdout=subprocess.DEVNULL)
        rows = []
        for stage in range(4):
            low, high = 0, args.max_layers + 1  # fits(low) or low == 0; not fits(high)
            while high - low > 1:
                middle = (low + high) // 2
                if fits(stage, middle, args, data):
                    low = middle
                else:
                    high = middle
            rows.append((stage, low))
            print(f"stage {stage}: {low} blocks", flush=True)
    n = args.ranks
    formula = {0: lambda p: 16 * p, 1: lambda p: 8 * p + 8 * p / n, 2: lambda p: 4 * p + 12 * p / n,
               3: lambda p: 16 * p / n}
    print(f"\nLargest tiny-family model (width 256, context 128, micro-batch 1) per ZeRO stage under "
          f"memory.limit_mb = {args.limit_mb} per rank on {n} ranks")
    print(f"{'stage':>5} {'blocks':>6} {'parameters':>11} {'model states MiB':>17}")
    for stage, layers in rows:
        p = parameters(layers)
        print(f"{stage:>5} {layers:>6} {p / 1e6:>10.2f}M {formula[stage](p) / 2**20:>17.1f}")


if __name__ == "__main__":
    main()
