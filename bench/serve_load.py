"""Serving throughput and latency of `meshtrain serve` under concurrent
clients, and the gain of continuous batching over one request at a time, in
one run.

Trains a `small` model for a few steps (or uses --checkpoint), starts the
server twice on loopback — with continuous batching (--max-batch 32) and one
request at a time (--max-batch 1) — and for 1, 8 and 32 concurrent clients
each sending --requests completions back to back, reports completion tokens/s
and the p50 / p99 request latency. Run from the repository root:

    .venv/bin/python bench/serve_load.py [--checkpoint DIR] [--clients 1 8 32] [--requests 4] [--max-tokens 64]
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")


def start(checkpoint, max_batch):
    proc = subprocess.Popen([MESHTRAIN, "serve", "--checkpoint", checkpoint, "--port", "0", "--max-batch",
                             str(max_batch), "--queue", "256"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    while True:
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if found:
            return proc, f"http://127.0.0.1:{found.group(1)}"
        if not line:
            raise RuntimeError("the server did not start")


def load(url, clients, requests, max_tokens):
    latencies, tokens = [], [0]
    lock = threading.Lock()

    def client(c):
        for r in range(requests):
            body = json.dumps({"prompt": f"{c} {r} The licence ", "max_tokens": max_tokens, "temperature": 0.8,
                               "seed": 100 * c + r}).encode()
            start = time.perf_counter()
            with urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body), timeout=600) as f:
                made = json.loads(f.read())["usage"]["completion_tokens"]
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens[0] += made

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(round(0.99 * (len(latencies) - 1))))]
    return tokens[0] / wall, statistics.median(latencies), p99


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        checkpoint = args.checkpoint
        if not checkpoint:
            subprocess.run([MESHTRAIN, "train", "--model.preset=small", "--training.steps=2", "--training.batch=2",
                            "--training.micro_batch=2", "--training.sample_tokens=0", f"--run.out={work}"],
                           check=True, capture_output=True)
            checkpoint = os.path.join(work, "checkpoints")
        print(f"{'server':>22} {'clients':>7} {'tokens/s':>9} {'p50 s':>7} {'p99 s':>7}")
        results = {}
        for max_batch, name in ((32, "continuous batching"), (1, "one at a time")):
            proc, url = start(checkpoint, max_batch)
            try:
                for clients in args.clients:
                    rate, p50, p99 = load(url, clients, args.requests, args.max_tokens)
                    results[(name, clients)] = rate
                    print(f"{name:>22} {clients:>7} {rate:>9.1f} {p50:>7.2f} {p99:>7.2f}", flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait()
        for clients in args.clients:
            gain = results[("continuous batching", clients)] / results[("one at a time", clients)]
            print(f"continuous batching / one at a time, {clients} clients: {gain:.2f}x tokens/s")


if __name__ == "__main__":
    main()
