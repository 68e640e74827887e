"""Context-parallel training at long sequences: tokens/s and memory per rank at
cp = 1, 2 and 4, against one rank's throughput scaled by cp.

For each sequence length, trains a small GPT (2 blocks, width 64, 4 heads,
vocabulary 256) for a few steps with one sequence per step: on 1 rank (cp 1),
then on cp ranks with parallel.cp = cp and each cp_impl asked for. Prints the
median tokens/s of the steps after the first, the counting allocator's peak
per rank (the largest; every rank of a group holds the same shapes) and, for cp
> 1, tokens/s divided by one rank's, and by one rank's x cp (1.0 would be
perfect scaling where every rank has cores of its own; on a machine with
fewer cores than ranks the first is the fair one: ranks share the cores one
rank's threads use). Every run has a per-rank memory limit (memory.limit_mb, default 6
GiB): a length one rank cannot hold stops with the allocator's message and is
printed as "does not fit". PyTorch's context parallel is not the peer: it
dispatches to the flash, memory-efficient and cuDNN attention kernels only,
which have no CPU implementation. Run from the repository root:

    .venv/bin/python bench/cp_train.py [--seq 4096,16384,32768] [--cp 2,4] [--impl ring,all_to_all]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")


def train(seq, cp, impl, args, data, out):
    """(median tokens/s, the largest rank's peak MiB) or None when it does not fit the limit."""
    command = [MESHTRAIN, "run", "-n", str(cp), "train", "--model.preset=tiny", "--model.layers=2",
               "--model.width=64", "--model.heads=4", f"--model.context={seq}", "--model.dropout=0",
               f"--parallel.cp={cp}", f"--parallel.cp_impl={impl}", f"--memory.limit_mb={args.limit_mb}",
               f"--training.steps={args.steps}", "--training.batch=1", "--training.micro_batch=1",
               "--training.sample_tokens=0", "--training.eval_every=0", "--training.eval_batches=1",
               "--checkpoint.every=0", "--checkpoint.resume=false", f"--data.train_file={data}/train.bin",
               f"--data.val_file={data}/train.bin", f"--run.out={out}"]  # val.bin is shorter than 32K
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        if "out of memory on rank" in done.stdout:
            return None
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}")
    steps = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in line]
    rates = [s["tokens_per_s"] for s in steps[1:]]
    # Per rank, each phase's peak; the most any rank held.
    peak = max(max(s["memory_mib"][k]) for s in steps for k in ("forward_peak", "backward_peak", "optimizer_peak"))
    return statistics.median(rates), peak


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", default="4096,16384,32768")
    parser.add_argument("--cp", default="2,4")
    parser.add_argument("--impl", default="ring,all_to_all")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--limit-mb", type=int, default=6144)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        subprocess.run([MESHTRAIN, "prepare", "/usr/share/common-licenses", "--out", data], check=True,
                       stdout=subprocess.DEVNULL)
        print("| sequence | cp | cp_impl | tokens/s | peak MiB per rank | ÷ 1 rank | ÷ (1 rank × cp) |")
        print("|---|---|---|---|---|---|---|")
        for seq in [int(s) for s in args.seq.split(",")]:
            one = train(seq, 1, "ring", args, data, os.path.join(data, f"run-{seq}-1"))
            print(f"| {seq} | 1 | – | " + (f"{one[0]:.0f} | {one[1]:.0f} | | |" if one else "does not fit | | | |"),
                  flush=True)
            for cp in [int(c) for c in args.cp.split(",")]:
                for impl in args.impl.split(","):
                    got = train(seq, cp, impl, args, data, os.path.join(data, f"run-{seq}-{cp}-{impl}"))
                    if got is None:
                        print(f"| {seq} | {cp} | {impl} | does not fit | | | |", flush=True)
                        continue
                    same = f"{got[0] / one[0]:.2f}" if one else "–"
                    scaled = f"{got[0] / (one[0] * cp):.2f}" if one else "–"
                    print(f"| {seq} | {cp} | {impl} | {got[0]:.0f} | {got[1]:.0f} | {same} | {scaled} |", flush=True)


if __name__ == "__main__":
    main()
