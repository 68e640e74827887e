"""Stragglers: fl.mode = "async" (FedBuff) against synchronous rounds when a
tenth of the clients are 10x slower (`fl simulate --slow-clients 0.1
--slow-factor 10`: each of them sleeps nine times its own training time).

The Shakespeare split by speaker (the corpus in ../shared/data, else
tests/data's excerpt), examples/fl/shakespeare.toml, 10 clients. The
synchronous federation runs --rounds rounds, each waiting for every client;
the async one updates its model every --buffer results (fl.async.buffer) for
up to --versions versions; a third run is synchronous with the straggler
remedy of over-selection, each round closing at 9 of the 10 clients. Per trial: the synchronous run's final validation
loss and wall time (elapsed_s of its last metrics row), and the time at which
the async run's validation loss first reached that loss. Medians over
--trials; the ratio is synchronous time / async time.

    .venv/bin/python bench/fl_async_vs_sync.py [--trials 3] [--rounds 8] [--versions 40] [--buffer 5]

docs/BENCHMARKS.md, "Federated stragglers: async against sync".
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")
CONFIG = os.path.join(ROOT, "examples", "fl", "shakespeare.toml")


def corpus():
    shared = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt")
    return shared if os.path.exists(shared) else os.path.join(ROOT, "tests", "data", "shakespeare_excerpt.txt")


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def simulate(work, name, args):
    out = os.path.join(work, name)
    cmd = [MESHTRAIN, "fl", "simulate", "--clients", "10", CONFIG, "--slow-clients", "0.1", "--slow-factor", "10",
           f"--fl.server.out={out}", "--fl.server.resume=false"] + args
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return rows(out)


def trial(work, a, t):
    split = os.path.join(work, "split")
    if not os.path.exists(split):
        subprocess.run([MESHTRAIN, "fl", "split", corpus(), "--out", split, "--by", "speaker"], check=True,
                       stdout=subprocess.DEVNULL)
    data = [f"--fl.data.clients_dir={split}", f"--fl.data.val_file={split}/val.bin"]
    sync = simulate(work, f"sync{t}", data + [f"--fl.rounds={a.rounds}"])
    target, sync_s = sync[-1]["val_loss"], sync[-1]["elapsed_s"]
    # The synchronous remedy: close each round at 9 of the 10 (Note [Sampling clients]).
    nine = simulate(work, f"nine{t}", data + [f"--fl.rounds={a.versions}", "--fl.clients_per_round=9",
                                                "--fl.over_select=0.12"])
    nine_at = next((r for r in nine if r["round"] > 0 and r["val_loss"] is not None and r["val_loss"] <= target), None)
    run = simulate(work, f"async{t}", data + [f"--fl.rounds={a.versions}", "--fl.mode=async", f"--fl.async.buffer={a.buffer}"])
    reached = next((r for r in run if r["round"] > 0 and r["val_loss"] is not None and r["val_loss"] <= target), None)
    refused = sum(len(r["dropped"]) for r in run)
    return {"sync_loss": target, "sync_s": sync_s, "nine_round": nine_at["round"] if nine_at else None,
            "nine_s": nine_at["elapsed_s"] if nine_at else None, "async_version": reached["round"] if reached else None,
            "async_s": reached["elapsed_s"] if reached else None, "async_final_loss": run[-1]["val_loss"],
            "async_refused": refused}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--versions", type=int, default=40)
    p.add_argument("--buffer", type=int, default=5)
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as work:
        for t in range(a.trials):
            r = trial(work, a, t)
            results.append(r)
            print(json.dumps(r), flush=True)
    reached = [r for r in results if r["async_s"] is not None]
    print(f"\n| mode | val loss | wall s (median of {a.trials}) |\n| --- | ---: | ---: |")
    print(f"| sync, {a.rounds} rounds of 10 clients | {statistics.median(r['sync_loss'] for r in results):.3f} | "
          f"{statistics.median(r['sync_s'] for r in results):.1f} |")
    nine = [r for r in results if r["nine_s"] is not None]
    if nine:
        print(f"| sync, each round closing at 9 of 10 (fl.clients_per_round=9, fl.over_select=0.12): first round at "
              f"that loss (median round {statistics.median(r['nine_round'] for r in nine):.0f}) | <= | "
              f"{statistics.median(r['nine_s'] for r in nine):.1f} |")
    if len(reached) < len(results):
        print(f"async did not reach the synchronous loss within {a.versions} versions in "
              f"{len(results) - len(reached)} of {len(results)} trials")
    if reached:
        print(f"| async, buffer {a.buffer}: first version at that loss (median version "
              f"{statistics.median(r['async_version'] for r in reached):.0f}) | <= | "
              f"{statistics.median(r['async_s'] for r in reached):.1f} |")
        both = [r for r in reached if r["nine_s"] is not None]
        print(f"\nsync / async wall time to the same loss: median "
              f"{statistics.median(r['sync_s'] / r['async_s'] for r in reached):.2f}x; sync closing at 9 / async: "
              f"{statistics.median(r['nine_s'] / r['async_s'] for r in both) if both else float('nan'):.2f}x; "
              f"results refused as too stale: "
              f"{statistics.median(r['async_refused'] for r in results):.0f} per run")


if __name__ == "__main__":
    main()
