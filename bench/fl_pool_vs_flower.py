"""Many clients on one machine: `meshtrain fl simulate --pool` against Flower's
simulation engine (flwr[simulation], Ray) on the same work: the Shakespeare
play split iid into --registered clients, the same small character GPT (the
PyTorch twin of meshtrain's in bench/reference/train_gpt.py), FedAvg with SGD,
each round sampling --per-round clients, the same rounds, local steps and
batch. Per (per round): rounds per minute (after start-up), the server's peak
memory (meshtrain: the `fl server` process; Flower: the process running its
ServerApp, Ray's workers not counted), bytes sent per round and the final
validation loss.

    .venv/bin/python bench/fl_pool_vs_flower.py [--registered 1000] [--per-round 10,100,1000] [--rounds 3]

Needs flwr[simulation] (scripts/setup.sh --bench). docs/BENCHMARKS.md, "Many
federated clients on one machine, vs Flower's simulation engine".
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "bench", "reference"))
sys.path.insert(0, os.path.join(ROOT, "tests", "fl"))
from fl_vs_flower import read_tokens  # noqa: E402
from hostile import peak_rss_mib  # noqa: E402

MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")
MODEL = dict(vocab=256, context=32, layers=2, heads=4, width=64)


def corpus():
    shared = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt")
    return shared if os.path.exists(shared) else os.path.join(ROOT, "tests", "data", "shakespeare_excerpt.txt")


def meshtrain_run(a, work, per_round):
    out = os.path.join(work, f"meshtrain-{per_round}")
    cmd = [MESHTRAIN, "fl", "simulate", "--clients", str(a.registered), "--pool", "2",
           os.path.join(ROOT, "examples", "fl", "shakespeare.toml"), f"--fl.data.clients_dir={work}/clients",
           f"--fl.data.val_file={work}/clients/val.bin", f"--fl.server.out={out}", "--fl.server.resume=false",
           f"--model.context={MODEL['context']}", f"--model.layers={MODEL['layers']}",
           f"--model.heads={MODEL['heads']}", f"--model.width={MODEL['width']}", f"--fl.rounds={a.rounds}",
           f"--fl.clients_per_round={per_round}", f"--fl.min_available={a.registered}", "--fl.min_fit=1",
           f"--fl.client.local_steps={a.local_steps}", f"--fl.client.batch={a.batch}", f"--fl.client.lr={a.lr}",
           "--fl.clip_norm=0", "--fl.deadline_s=3600", "--fl.wait_clients_s=600"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(out + ".log", "w"))
    peak, server = 0.0, None
    while proc.poll() is None:  # the server is simulate's first child
        if server is None:
            children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            server = children[0] if children else None
        if server:
            peak = max(peak, peak_rss_mib(server) or 0.0)
        time.sleep(0.2)
    if proc.returncode != 0:
        sys.exit(f"meshtrain failed: see {out}.log")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]
    return {"rounds_per_min": 60 / statistics.median(r["seconds"] for r in rows),
            "server_peak_mib": peak, "mb_per_round": statistics.median(
                (r["uplink_bytes"] + r["downlink_bytes"]) / 1e6 for r in rows), "val_loss": rows[-1]["val_loss"]}


def flower_child(a, work, per_round, result_path):
    """Runs in its own process: Flower's simulation engine, its ServerApp in this process."""
    import flwr as fl
    import torch
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from train_gpt import GPT
    torch.manual_seed(1)
    torch.set_num_threads(1)
    dirs = sorted(d for d in os.listdir(os.path.join(work, "clients")) if d.startswith("client"))[:a.registered]
    val = read_tokens(os.path.join(work, "clients", "val.bin"))
    model = GPT(**MODEL)
    params = sum(p.numel() for p in model.parameters())
    rows, start = [], [time.time()]

    def evaluate(server_round, parameters, config):
        with torch.no_grad():
            for p, w in zip(model.parameters(), parameters):
                p.copy_(torch.from_numpy(np.asarray(w, dtype=np.float32)))
            c, losses = MODEL["context"], []
            for b in range(8):  # meshtrain's fl.data.eval_batches of the example, rows in order
                batch = torch.from_numpy(np.stack([val[w * c: w * c + c + 1] for w in range(b * a.batch, (b + 1) * a.batch)]))
                losses.append(model(batch[:, :-1], batch[:, 1:]).item())
        now = time.time()
        rows.append({"round": server_round, "val_loss": statistics.mean(losses), "seconds": now - start[0]})
        start[0] = now
        return statistics.mean(losses), {}

    class Client(fl.client.NumPyClient):
        def __init__(self, data):
            self.tokens = read_tokens(os.path.join(work, "clients", data, "train.bin"))
            self.rng = np.random.default_rng(abs(hash(data)) % (2**32))

        def fit(self, parameters, config):
            net = GPT(**MODEL)
            with torch.no_grad():
                for p, w in zip(net.parameters(), parameters):
                    p.copy_(torch.from_numpy(w))
            opt = torch.optim.SGD(net.parameters(), lr=a.lr)
            c, windows = MODEL["context"], (len(self.tokens) - 1) // MODEL["context"]
            for _ in range(a.local_steps):
                rows_ = self.rng.integers(0, windows, a.batch)
                batch = torch.from_numpy(np.stack([self.tokens[w * c: w * c + c + 1] for w in rows_]))
                loss = net(batch[:, :-1], batch[:, 1:])
                opt.zero_grad()
                loss.backward()
                opt.step()
            return [p.detach().numpy().copy() for p in net.parameters()], windows, {}

    def client_fn(context):
        return Client(dirs[int(context.node_config["partition-id"])]).to_client()

    def server_fn(context):
        strategy = fl.server.strategy.FedAvg(
            fraction_fit=per_round / a.registered, min_fit_clients=per_round, fraction_evaluate=0.0,
            min_evaluate_clients=0, min_available_clients=a.registered, evaluate_fn=evaluate,
            initial_parameters=ndarrays_to_parameters([p.detach().numpy() for p in model.parameters()]))
        return fl.server.ServerAppComponents(strategy=strategy, config=fl.server.ServerConfig(num_rounds=a.rounds))

    fl.simulation.run_simulation(server_app=fl.server.ServerApp(server_fn=server_fn),
                                 client_app=fl.client.ClientApp(client_fn=client_fn), num_supernodes=a.registered,
                                 backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    rounds = [r for r in rows if r["round"] > 0]
    with open(result_path, "w") as f:
        json.dump({"rounds_per_min": 60 / statistics.median(r["seconds"] for r in rounds),
                   "server_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "mb_per_round": 2 * 4 * params * per_round / 1e6, "val_loss": rounds[-1]["val_loss"]}, f)


def flower_run(a, work, per_round):
    result = os.path.join(work, f"flower-{per_round}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--flower-child", str(per_round), "--work", work] + sys.argv[1:]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=open(result + ".log", "w"),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0 or not os.path.exists(result):
        sys.exit(f"Flower failed: see {result}.log")
    return json.load(open(result))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--registered", type=int, default=1000)
    p.add_argument("--per-round", default="10,100,1000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--local-steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--skip-flower", action="store_true")
    p.add_argument("--flower-child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    a, _ = p.parse_known_args()
    if a.flower_child:
        return flower_child(a, a.work, a.flower_child, os.path.join(a.work, f"flower-{a.flower_child}.json"))
    with tempfile.TemporaryDirectory() as work:
        # A client's validation text is its last speeches: past 2,000 clients the play is repeated so that
        # each has a few (a systems benchmark; the repeats change what is learned little).
        text = os.path.join(work, "play.txt")
        with open(text, "w") as f:
            f.write((open(corpus()).read() + "\n") * max(1, -(-a.registered // 2000)))
        subprocess.run([MESHTRAIN, "fl", "split", text, "--out", os.path.join(work, "clients"), "--by", "iid",
                        "--clients", str(a.registered), "--min-bytes", "1"], check=True, stdout=subprocess.DEVNULL)
        print(f"| per round of {a.registered:,} | system | rounds/min | server peak MiB | MB per round | final val loss |")
        print("| ---: | --- | ---: | ---: | ---: | ---: |")
        for per_round in [int(x) for x in a.per_round.split(",")]:
            systems = [("meshtrain --pool 2", meshtrain_run)] + ([] if a.skip_flower else [("Flower (Ray)", flower_run)])
            for name, run in systems:
                r = run(a, work, per_round)
                print(f"| {per_round:,} | {name} | {r['rounds_per_min']:.1f} | {r['server_peak_mib']:.0f} | "
                      f"{r['mb_per_round']:.1f} | {r['val_loss']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
