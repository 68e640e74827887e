"""Federated learning under attack: the validation loss after R rounds of 8
clients of which 0, 1 or 2 are hostile, per aggregation rule — meshtrain's
mean (FedAvg with its default bounds), median, trimmed mean and Krum beside
Flower's FedAvg, FedMedian, FedTrimmedAvg and Krum on the same split by
speaking role, model, local steps and attack — and DP-FedAvg's validation
loss against the ε its accountant reports, in the same run.

The attack (--attack): "signflip" sends minus ten times the global model's
last change (Flower's attacker returns the global weights plus that); "huge"
sends 1e30 in every entry claiming 2^62 examples. meshtrain's attackers speak
the protocol from stubs generated from federation.proto (tests/fl/hostile.py).

    .venv/bin/python bench/fl_robust_vs_flower.py [--rounds 20] [--attack signflip] [--skip-flower] [--skip-dp]

Needs flwr (scripts/setup.sh --bench). Writes <work>/robust.json and prints tables.
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
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests", "fl"))
import fl_vs_flower as base  # noqa: E402

RULES = {  # meshtrain rule: (its [fl] overrides, Flower's strategy)
    "mean": ([], "FedAvg"),
    "median": (["--fl.aggregation=median"], "FedMedian"),
    "trimmed_mean": (["--fl.aggregation=trimmed_mean", "--fl.trim_fraction=0.25"], "FedTrimmedAvg"),
    "krum": (["--fl.aggregation=krum", "--fl.byzantine=2"], "Krum"),
}


def fl_args(a):
    return [f"--model.layers={a.layers}", f"--model.width={a.width}", f"--model.heads={a.heads}",
            f"--model.context={a.context}", f"--fl.client.local_steps={a.local_steps}", f"--fl.client.batch={a.batch}",
            f"--fl.client.lr={a.lr}", "--fl.deadline_s=600", "--fl.wait_clients_s=120",
            f"--fl.data.eval_batches={a.eval_batches}", "--fl.server.insecure=true"]


def meshtrain_run(a, pb, honest, attackers, label, overrides):
    from hostile import Attacker, Federation
    fed = Federation(a.meshtrain, a.work, label, honest, fl_args(a) + overrides, extra_available=attackers,
                     rounds=a.rounds, min_fit=len(honest) + attackers)
    threads = [Attacker(*pb, fed.port, a.attack, fed.server.pid, name=f"attacker{i}", declared=a.declared)
               for i in range(attackers)]
    for t in threads:
        t.start()
    start = time.time()
    rows = fed.finish(timeout=3600)
    for t in threads:
        t.join(timeout=60)
    rounds = [r for r in rows if r["round"] > 0]
    return {"val_loss": [r["val_loss"] for r in rows], "wall_s": time.time() - start,
            "epsilon": rounds[-1].get("epsilon"), "rolled_back": sum(r["status"] == "rolled_back" for r in rounds),
            "seconds_per_round": statistics.median(r["seconds"] for r in rounds)}


# ---- Flower: the same GPT in PyTorch, its strategies, the same attack -------------

def flower_attacker(a, server):
    import flwr as fl

    class Attacker(fl.client.NumPyClient):
        previous = None

        def fit(self, parameters, config):
            weights = [np.asarray(w) for w in parameters]
            if a.attack == "huge":
                return [np.full_like(w, 1e30) for w in weights], 1 << 62, {}
            before = self.previous if self.previous is not None else weights
            self.previous = weights
            return [w - 10.0 * (w - p) for w, p in zip(weights, before)], a.declared, {}

    fl.client.start_client(server_address=server, client=Attacker().to_client())


def flower_server(a, port, out, strategy_name):
    extra = {"Krum": dict(num_malicious_clients=2), "FedTrimmedAvg": dict(beta=0.25)}.get(strategy_name, {})
    base.flower_server(a, a.work, port, out, strategy_name, extra, clients=8,
                       val_file=os.path.join(a.work, "speakers", "val.bin"))


def flower_run(a, honest, attackers, strategy_name):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    out = os.path.join(a.work, f"flower_{strategy_name}_{attackers}.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(os.path.join(a.work, "flower.log"), "a")
    me = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:]
    start = time.time()
    server = subprocess.Popen(me + ["--role", "flower-server", "--port", str(port), "--out", out, "--strategy",
                                    strategy_name], env=env, stdout=log, stderr=log)
    time.sleep(3)
    procs = [subprocess.Popen(me + ["--role", "flower-client", "--port", str(port), "--data",
                                    os.path.join(a.work, "speakers", d)], env=env, stdout=log, stderr=log)
             for d in honest]
    procs += [subprocess.Popen(me + ["--role", "flower-attacker", "--port", str(port)], env=env, stdout=log,
                               stderr=log) for _ in range(attackers)]
    server.wait()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    rows = [json.loads(line) for line in open(out)]
    return {"val_loss": [r["val_loss"] for r in rows], "wall_s": time.time() - start}


def show(v):
    return "NaN" if v is None or not np.isfinite(v) else f"{v:.3f}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default=os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt"))
    p.add_argument("--meshtrain", default=os.path.join(ROOT, "build", "bin", "meshtrain"))
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "fl_robust"))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--attack", default="signflip", choices=["signflip", "huge"])
    p.add_argument("--attackers", default="0,1,2")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--dp-clip", type=float, default=0.5, help="DP-FedAvg's S (the honest update norms are near it)")
    p.add_argument("--dp-z", default="0.01,0.03,0.1", help="noise multipliers")
    p.add_argument("--skip-flower", action="store_true")
    p.add_argument("--skip-dp", action="store_true")
    p.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--data", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="", help=argparse.SUPPRESS)
    p.add_argument("--declared", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    if a.role == "flower-client":
        return base.flower_client(a, a.data, f"127.0.0.1:{a.port}")
    if a.role == "flower-attacker":
        return flower_attacker(a, f"127.0.0.1:{a.port}")
    if a.role == "flower-server":
        return flower_server(a, a.port, a.out, a.strategy)

    os.makedirs(a.work, exist_ok=True)
    subprocess.run(["rm", "-rf", os.path.join(a.work, "speakers")], check=True)
    subprocess.run([a.meshtrain, "fl", "split", a.text, "--by", "speaker", "--out", os.path.join(a.work, "speakers")],
                   check=True, stdout=subprocess.DEVNULL)
    listing = sorted(json.load(open(os.path.join(a.work, "speakers", "clients.json"))), key=lambda c: -c["train_bytes"])
    roles = [c["dir"] for c in listing[:8]]
    # An attacker declares as many sequences as the median honest client (the Join cap then binds at that).
    a.declared = int(statistics.median(c["train_bytes"] // a.context for c in listing[:8]))
    sys.argv += ["--declared", str(a.declared)]
    from hostile import stubs
    pb = stubs(a.work)
    results = {"args": vars(a), "robust": [], "dp": []}
    for attackers in [int(x) for x in a.attackers.split(",")]:
        honest = roles[:8 - attackers]
        for rule in a.rules.split(","):
            overrides, flower_name = RULES[rule]
            m = meshtrain_run(a, pb, honest, attackers, f"{rule}_{attackers}", overrides)
            row = {"attackers": attackers, "rule": rule, "meshtrain": m}
            print(f"{attackers} attacker(s), {rule}: meshtrain {show(m['val_loss'][-1])} ({m['wall_s']:.0f} s)",
                  file=sys.stderr, flush=True)
            if not a.skip_flower:
                row["flower"] = flower_run(a, honest, attackers, flower_name)
                print(f"  Flower {flower_name}: {show(row['flower']['val_loss'][-1])}", file=sys.stderr, flush=True)
            results["robust"].append(row)
    if not a.skip_dp:
        for z in [0.0] + [float(x) for x in a.dp_z.split(",")]:
            overrides = [f"--fl.clip_norm={a.dp_clip}"] + ([f"--fl.dp.noise_multiplier={z}"] if z > 0 else [])
            m = meshtrain_run(a, pb, roles, 0, f"dp_{z}", overrides)
            results["dp"].append({"z": z, "meshtrain": m})
            print(f"DP z = {z}: epsilon {m['epsilon']}, val loss {show(m['val_loss'][-1])}", file=sys.stderr, flush=True)

    print(f"\n{a.rounds} rounds, 8 clients (the largest speaking roles, the last ones replaced by attackers), "
          f"attack {a.attack}; model {a.layers}x{a.width}, context {a.context}; {a.local_steps} local SGD steps "
          f"(batch {a.batch}, lr {a.lr})\n")
    print("| attackers | rule | meshtrain val loss | Flower strategy | Flower val loss |")
    print("|---|---|---|---|---|")
    for r in results["robust"]:
        flower = r.get("flower")
        print(f"| {r['attackers']} | {r['rule']} | {show(r['meshtrain']['val_loss'][-1])} | {RULES[r['rule']][1]} | "
              f"{show(flower['val_loss'][-1]) if flower else '-'} |")
    if results["dp"]:
        print(f"\n| DP-FedAvg z (S = {a.dp_clip}) | epsilon (delta 1e-5) | val loss |")
        print("|---|---|---|")
        for r in results["dp"]:
            eps = r["meshtrain"]["epsilon"]
            print(f"| {r['z']} | {'-' if eps is None else f'{eps:.3g}'} | {show(r['meshtrain']['val_loss'][-1])} |")
    json.dump(results, open(os.path.join(a.work, "robust.json"), "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
