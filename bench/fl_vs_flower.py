"""Federated learning on Shakespeare split by speaking role (LEAF's benchmark):
meshtrain's full FedAvg against its communication-efficient updates (low rank,
random mask, sketched = rotation + subsampling + 2-bit quantisation) — the
validation loss after R rounds against the uplink bytes it cost — and against
Flower (flwr, its clients training the same GPT in PyTorch) doing FedAvg on
the same clients: seconds per round and loss per round, in the same run.

    .venv/bin/python bench/fl_vs_flower.py [--rounds 20] [--clients 8] [--skip-flower]

Needs flwr in the venv (scripts/setup.sh --bench installs it). Writes
<work>/summary.json, <work>/loss.svg (every configuration) and prints a table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "reference"))

CONFIGS = {  # label: [fl] overrides
    "full": [],
    "low_rank(8)": ["fl.compression.structure=\"low_rank\"", "fl.compression.rank=8"],
    "mask(0.25)": ["fl.compression.structure=\"mask\"", "fl.compression.mask_fraction=0.25"],
    "sketch(rotate+keep 0.25+2 bit)": ["fl.compression.rotate=true", "fl.compression.keep=0.25",
                                         "fl.compression.bits=2"],
    # Not in the default list: secure aggregation (t = 6 of 8, 16-bit ring quantisation).
    "secagg(t=6)": ["fl.secagg.enabled=true", "fl.secagg.threshold=6"],
}
DEFAULT_CONFIGS = ["full", "low_rank(8)", "mask(0.25)", "sketch(rotate+keep 0.25+2 bit)"]


def read_tokens(path):
    with open(path, "rb") as f:
        header = f.read(32)
        assert header[:8] == b"MTTOKENS", path
        width = int.from_bytes(header[12:16], "little")
        count = int.from_bytes(header[16:24], "little")
        dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[width]
        return np.frombuffer(f.read(count * width), dtype=dtype).astype(np.int64)


def model_args(a):
    return dict(vocab=256, context=a.context, layers=a.layers, heads=a.heads, width=a.width)


def write_config(a, path):
    with open(path, "w") as f:
        f.write(f"""[model]
preset = "tiny"
context = {a.context}
layers = {a.layers}
heads = {a.heads}
width = {a.width}

[fl]
rounds = {a.rounds}
min_available = {a.clients}
min_fit = {a.clients}
deadline_s = 600

[fl.client]
local_steps = {a.local_steps}
batch = {a.batch}
lr = {a.lr}

[fl.data]
eval_batches = {a.eval_batches}

[fl.server]
insecure = true
""")


def run_meshtrain(a, work, label, overrides):
    out = os.path.join(work, "meshtrain_" + "".join(c if c.isalnum() else "_" for c in label))
    subprocess.run(["rm", "-rf", out], check=True)
    cmd = [a.meshtrain, "fl", "simulate", "--clients", str(a.clients), os.path.join(work, "fl.toml"),
           f"--fl.data.clients_dir={work}/clients", f"--fl.data.val_file={work}/clients/val.bin",
           f"--fl.server.out={out}", f"--fl.label={label}"] + ["--" + o for o in overrides]
    start = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "simulate.log"), "a"))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rounds = [r for r in rows if r["round"] > 0]
    return {"label": label, "metrics": os.path.join(out, "metrics.jsonl"), "wall_s": time.time() - start,
            "val_loss": [rows[0]["val_loss"]] + [r["val_loss"] for r in rounds],
            "uplink_bytes": rounds[-1]["cumulative_uplink_bytes"],
            "downlink_bytes": rounds[-1]["cumulative_downlink_bytes"],
            "seconds_per_round": statistics.median(r["seconds"] for r in rounds)}


# ---- Flower: the same GPT in PyTorch, FedAvg, the same clients -------------------

def flower_client(a, data, server):
    import flwr as fl
    import torch
    from train_gpt import GPT
    torch.set_num_threads(1)
    tokens = read_tokens(os.path.join(data, "train.bin"))
    windows = (len(tokens) - 1) // a.context
    model = GPT(**model_args(a))
    rng = np.random.default_rng(abs(hash(data)) % (2**32))

    class Client(fl.client.NumPyClient):
        def fit(self, parameters, config):
            with torch.no_grad():
                for p, w in zip(model.parameters(), parameters):
                    p.copy_(torch.from_numpy(w))
            opt = torch.optim.SGD(model.parameters(), lr=a.lr)
            for _ in range(a.local_steps):
                rows = rng.integers(0, windows, a.batch)
                batch = torch.from_numpy(np.stack([tokens[w * a.context: w * a.context + a.context + 1] for w in rows]))
                loss = model(batch[:, :-1], batch[:, 1:])
                opt.zero_grad()
                loss.backward()
                opt.step()
            return [p.detach().numpy().copy() for p in model.parameters()], windows, {}

    fl.client.start_client(server_address=server, client=Client().to_client())


def flower_server(a, work, port, out, strategy_name="FedAvg", extra=None, clients=None, val_file=None):
    """Flower's server with `strategy_name` (extra: its own arguments) for `clients` clients, the
    validation loss of the global model after every round in `out`."""
    import flwr as fl
    import torch
    from train_gpt import GPT
    torch.manual_seed(1)
    torch.set_num_threads(1)
    clients = clients or a.clients
    model = GPT(**model_args(a))
    val = read_tokens(val_file or os.path.join(work, "clients", "val.bin"))
    rows = []
    start = [time.time()]

    def evaluate(server_round, parameters, config):
        with torch.no_grad():
            for p, w in zip(model.parameters(), parameters):
                p.copy_(torch.from_numpy(np.asarray(w, dtype=np.float32)))
            losses = []
            for b in range(a.eval_batches):
                batch = torch.from_numpy(np.stack([val[w * a.context: w * a.context + a.context + 1]
                                                   for w in range(b * a.batch, (b + 1) * a.batch)]))
                losses.append(model(batch[:, :-1], batch[:, 1:]).item())
        now = time.time()
        params = sum(p.numel() for p in model.parameters())
        rows.append({"round": server_round, "label": "Flower " + strategy_name, "val_loss": statistics.mean(losses),
                     "seconds": now - start[0], "cumulative_uplink_bytes": 4 * params * clients * server_round})
        start[0] = now
        return statistics.mean(losses), {}

    strategy = getattr(fl.server.strategy, strategy_name)(
        fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=clients, min_available_clients=clients,
        evaluate_fn=evaluate,
        initial_parameters=fl.common.ndarrays_to_parameters([p.detach().numpy() for p in model.parameters()]),
        **(extra or {}))
    fl.server.start_server(server_address=f"127.0.0.1:{port}", config=fl.server.ServerConfig(num_rounds=a.rounds),
                           strategy=strategy)
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def run_flower(a, work, dirs):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    out = os.path.join(work, "flower_metrics.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(os.path.join(work, "flower.log"), "w")
    me = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:]
    start = time.time()
    server = subprocess.Popen(me + ["--role", "flower-server", "--port", str(port), "--out", out], env=env,
                              stdout=log, stderr=log)
    time.sleep(3)
    clients = [subprocess.Popen(me + ["--role", "flower-client", "--port", str(port), "--data", d], env=env,
                                stdout=log, stderr=log) for d in dirs]
    server.wait()
    for c in clients:
        try:
            c.wait(timeout=30)
        except subprocess.TimeoutExpired:
            c.kill()
    rows = [json.loads(line) for line in open(out)]
    rounds = [r for r in rows if r["round"] > 0]
    return {"label": "Flower FedAvg", "metrics": out, "wall_s": time.time() - start,
            "val_loss": [r["val_loss"] for r in rows], "uplink_bytes": rounds[-1]["cumulative_uplink_bytes"],
            "seconds_per_round": statistics.median(r["seconds"] for r in rounds)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default=os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt"))
    p.add_argument("--meshtrain", default=os.path.join(ROOT, "build", "bin", "meshtrain"))
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "fl_bench"))
    p.add_argument("--clients", type=int, default=8, help="the largest speaking roles")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated labels of " + ", ".join(CONFIGS))
    p.add_argument("--skip-flower", action="store_true")
    p.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--data", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "flower-client":
        return flower_client(a, a.data, f"127.0.0.1:{a.port}")
    if a.role == "flower-server":
        return flower_server(a, a.work, a.port, a.out)

    os.makedirs(a.work, exist_ok=True)
    subprocess.run(["rm", "-rf", os.path.join(a.work, "clients")], check=True)
    subprocess.run([a.meshtrain, "fl", "split", a.text, "--by", "speaker", "--out", os.path.join(a.work, "clients")],
                   check=True)
    listing = json.load(open(os.path.join(a.work, "clients", "clients.json")))
    listing.sort(key=lambda c: -c["train_bytes"])
    dirs = [os.path.join(a.work, "clients", c["dir"]) for c in listing[:a.clients]]
    write_config(a, os.path.join(a.work, "fl.toml"))
    results = []
    for label in a.configs.split(","):
        results.append(run_meshtrain(a, a.work, label, CONFIGS[label]))
        print(f"meshtrain {label}: done in {results[-1]['wall_s']:.0f} s", file=sys.stderr)
    if not a.skip_flower:
        results.append(run_flower(a, a.work, dirs))
    full = next((r for r in results if r["label"] == "full"), results[0])
    print(f"\n{len(listing)} speaking roles; the {a.clients} largest as clients, {a.rounds} rounds of {a.local_steps} "
          f"local SGD steps (batch {a.batch}, lr {a.lr}); model {a.layers}x{a.width}, context {a.context}\n")
    print("| configuration | uplink bytes | vs full | val loss start -> end | s/round (median) | wall s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['label']} | {r['uplink_bytes']:,} | {full['uplink_bytes'] / r['uplink_bytes']:.1f}x fewer | "
              f"{r['val_loss'][0]:.3f} -> {r['val_loss'][-1]:.3f} | {r['seconds_per_round']:.2f} | {r['wall_s']:.0f} |")
    subprocess.run([a.meshtrain, "fl", "plot"] + [r["metrics"] for r in results] +
                   ["-o", os.path.join(a.work, "loss.svg")], check=True, stdout=subprocess.DEVNULL)
    json.dump({"args": vars(a), "results": results}, open(os.path.join(a.work, "summary.json"), "w"), indent=1)
    print(f"\npicture: {a.work}/loss.svg; rows: {a.work}/summary.json")


if __name__ == "__main__":
    sys.exit(main())
