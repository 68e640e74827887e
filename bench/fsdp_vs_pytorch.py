"""Fully sharded training, meshtrain ZeRO-3 against PyTorch FSDP2, in one run.

For each rank count, runs alternately: `meshtrain bench train` with
parallel.zero_stage=3 (prefetch on), the same with prefetch off, and
bench/reference/train_gpt.py --fsdp (`fully_shard` per block and the root,
gloo, CPU, the torch of the project's virtual environment) — same model,
global batch, micro-batch, optimizer and threads per rank. Prints medians of:
tokens/s and their ratio; per-rank memory as both sides see it (peak RSS
growth from just before the model is built; the same measure on both sides)
and its ratio; meshtrain's counted model states after a step against
16Ψ/N + one gathered unit (the ZeRO-3 goal is <= 1.05x); and how much
all-gather wait prefetch hides: 1 - exposed gather time with prefetch /
without. Run from the repository root:

    .venv/bin/python bench/fsdp_vs_pytorch.py [--ranks 2 4] [--preset tiny] [--repeats 3]
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_vs_pytorch import MESHTRAIN, REFERENCE, free_port, run  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()

    cores = os.cpu_count()
    rows = []
    for ranks in args.ranks:
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // ranks)))
        ours_cmd = [MESHTRAIN, "run", "-n", str(ranks), "bench", "train", "--steps", str(args.steps),
                    f"--model.preset={args.preset}", f"--training.batch={args.batch}",
                    f"--training.micro_batch={args.micro_batch}", "--parallel.zero_stage=3", "--run.out=runs/bench-fsdp"]
        ours, unprefetched, theirs = [], [], []
        for _ in range(args.repeats):
            ours.append(run(ours_cmd, env))
            unprefetched.append(run(ours_cmd + ["--parallel.prefetch=false"], env))
            theirs.append(run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                               "--master_addr=127.0.0.1", f"--master_port={free_port()}", REFERENCE, "--fsdp",
                               "--preset", args.preset, "--batch", str(args.batch), "--micro-batch",
                               str(args.micro_batch), "--steps", str(args.steps)], env))
        med = lambda runs, key: statistics.median(r[key] for r in runs)
        worst = lambda runs, key: statistics.median(max(r[key]) for r in runs)
        psi = ours[0]["parameters"]
        unit = ours[0]["largest_unit_numel"]
        goal_bytes = 16 * psi / ranks + 4 * unit
        states = worst(ours, "counted_model_states_mib") * 2**20
        gather_on, gather_off = med(ours, "exposed_gather_s_per_step"), med(unprefetched, "exposed_gather_s_per_step")
        rows.append({
            "ranks": ranks, "preset": args.preset, "parameters": psi,
            "meshtrain_tokens_per_s": med(ours, "tokens_per_s"), "pytorch_tokens_per_s": med(theirs, "tokens_per_s"),
            "no_prefetch_tokens_per_s": med(unprefetched, "tokens_per_s"),
            "meshtrain_rss_growth_mib": worst(ours, "rss_growth_mib"),
            "pytorch_rss_growth_mib": worst(theirs, "rss_growth_mib"),
            "meshtrain_counted_peak_mib": worst(ours, "counted_peak_mib"),
            "model_states_mib": states / 2**20, "goal_mib": goal_bytes / 2**20,
            "exposed_gather_ms": 1e3 * gather_on, "exposed_gather_ms_no_prefetch": 1e3 * gather_off,
            "exposed_reduce_ms": 1e3 * med(ours, "exposed_reduce_s_per_step"),
        })
        r = rows[-1]
        r["throughput_ratio"] = r["meshtrain_tokens_per_s"] / r["pytorch_tokens_per_s"]
        r["memory_ratio"] = r["meshtrain_rss_growth_mib"] / r["pytorch_rss_growth_mib"]
        r["states_vs_goal"] = states / goal_bytes
        r["prefetch_hides"] = 1 - gather_on / gather_off if gather_off > 0 else 0.0
        print(json.dumps(r), flush=True)

    print(f"\nmeshtrain ZeRO-3 vs PyTorch {theirs[0]['torch']} FSDP2 (gloo, CPU): {args.preset}, global batch {args.batch}, "
          f"micro-batch {args.micro_batch}, {args.steps} timed steps, medians of {args.repeats} alternating runs; "
          f"OMP_NUM_THREADS = {cores} cores / ranks")
    print(f"{'ranks':>5} {'ours tok/s':>10} {'FSDP2 tok/s':>11} {'ratio':>6} {'ours RSS+':>9} {'FSDP2 RSS+':>10} "
          f"{'ratio':>6} {'states MiB':>10} {'16Ψ/N+unit':>10} {'ratio':>6} {'gather ms':>9} {'no-pf ms':>8} {'hidden':>6}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['meshtrain_tokens_per_s']:>10.0f} {r['pytorch_tokens_per_s']:>11.0f} "
              f"{r['throughput_ratio']:>6.2f} {r['meshtrain_rss_growth_mib']:>9.1f} {r['pytorch_rss_growth_mib']:>10.1f} "
              f"{r['memory_ratio']:>6.2f} {r['model_states_mib']:>10.2f} {r['goal_mib']:>10.2f} {r['states_vs_goal']:>6.3f} "
              f"{r['exposed_gather_ms']:>9.1f} {r['exposed_gather_ms_no_prefetch']:>8.1f} {100 * r['prefetch_hides']:>5.0f}%")


if __name__ == "__main__":
    main()
