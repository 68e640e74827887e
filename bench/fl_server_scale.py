"""How `meshtrain fl server` grows with its clients: N clients join, each
holding its Presence call and a long poll open the whole time, as real
clients do; each round samples K of them (fl.clients_per_round), which answer
at once with an all-zero update (the clients do no training: what is measured
is the server). Per (N, K): the server's peak memory (VmHWM) and threads,
seconds per round from its metrics, and bytes per round.

The clients are asyncio coroutines over a few gRPC channels in this one
process, speaking the protocol from stubs generated from federation.proto
(tests/fl/hostile.py), so that thousands fit on two cores.

    .venv/bin/python bench/fl_server_scale.py [--clients 100,1000,5000] [--per-round 100,1000] [--rounds 3]

With --check (CTest fl.server_scale: 1,000 clients, 100 a round, 2 rounds) it
exits 1 unless every round completed with its target and the server kept
fewer than 64 threads (Note [Calls without threads]).

Writes <work>/scale.json and prints a table (docs/BENCHMARKS.md, "Federated server at scale").
"""
import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fl"))
from hostile import CHUNK, PROTOCOL, chunks, sketch_seed, stubs  # noqa: E402

CLIENTS_PER_CHANNEL = 200


def status_of(pid):
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            values[key] = rest.split()[0] if rest.split() else ""
    return int(values["VmHWM"]) / 1024, int(values["VmRSS"]) / 1024, int(values["Threads"])


async def client(pb, stub, name, joined):
    reply = await stub.Join(pb.JoinRequest(client_id=name, examples=100, protocol=PROTOCOL), wait_for_ready=True)
    request = pb.PollRequest(client_id=name, session=reply.session)
    presence = stub.Presence(request)  # held open, never read: the server ends it when the federation stops
    joined.append(name)
    zero = {}
    try:
        while True:
            data = b"".join([c.data async for c in stub.PollChunks(request)])
            task = pb.Task.FromString(data)
            if task.kind == pb.Task.STOP:
                return
            if task.kind != pb.Task.FIT:
                continue
            result = pb.Result(client_id=name, session=reply.session, round=task.round, kind=pb.Task.FIT,
                               examples=100, train_loss=1.0)
            for i, w in enumerate(task.weights):
                size = len(w.data) // 4
                zero.setdefault(size, bytes(4 * size))
                result.update.add(index=i, seed=sketch_seed(task.fit.seed, i, name), length=size, values=zero[size])
            data = result.SerializeToString()
            await stub.SubmitChunks(chunks(data, pb, name, reply.session, round=task.round, kind=pb.Task.FIT))
    finally:
        presence.cancel()


async def federation(pb, pb_grpc, port, count):
    options = [("grpc.max_receive_message_length", 2 * CHUNK), ("grpc.max_send_message_length", 2 * CHUNK)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
                for _ in range((count + CLIENTS_PER_CHANNEL - 1) // CLIENTS_PER_CHANNEL)]
    stubs_ = [pb_grpc.FederationStub(c) for c in channels]
    joined = []
    await asyncio.gather(*[client(pb, stubs_[i // CLIENTS_PER_CHANNEL], f"c{i:05d}", joined) for i in range(count)])
    for c in channels:
        await c.close()


def run(meshtrain, pb, pb_grpc, work, count, per_round, rounds, model):
    out = os.path.join(work, f"n{count}_k{per_round}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    port_file = os.path.join(out, "port")
    log = open(os.path.join(out, "server.log"), "w")
    server = subprocess.Popen([meshtrain, "fl", "server", "--port-file", port_file, "--fl.server.listen=127.0.0.1:0",
                               "--fl.server.insecure=true", f"--fl.server.out={out}", f"--fl.rounds={rounds}",
                               f"--fl.min_available={count}", f"--fl.min_fit={per_round}",
                               f"--fl.clients_per_round={per_round}", "--fl.wait_clients_s=600", "--fl.deadline_s=600",
                               "--fl.clip_norm=0"] + model, stdout=log, stderr=log)
    while not (os.path.exists(port_file) and open(port_file).read().strip()):
        if server.poll() is not None:
            raise RuntimeError(open(os.path.join(out, "server.log")).read())
        time.sleep(0.05)
    port = int(open(port_file).read())
    threads, peak = [0], [0.0]

    async def watch():
        while server.poll() is None:
            try:
                hwm, _, count_ = status_of(server.pid)
            except (OSError, KeyError):
                break
            threads[0], peak[0] = max(threads[0], count_), max(peak[0], hwm)
            await asyncio.sleep(0.2)

    async def main():
        watcher = asyncio.create_task(watch())
        start = time.time()
        await federation(pb, pb_grpc, port, count)
        await asyncio.get_running_loop().run_in_executor(None, server.wait)
        await watcher
        return time.time() - start

    wall = asyncio.run(main())
    log.close()
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    played = [r for r in rows if r["round"] > 0]
    return {"clients": count, "per_round": per_round, "rounds_ok": sum(r["status"] == "ok" for r in played),
            "seconds_per_round": sorted(r["seconds"] for r in played)[len(played) // 2],
            "bytes_per_round": (played[-1]["cumulative_uplink_bytes"] + played[-1]["cumulative_downlink_bytes"]) / len(played),
            "server_threads": threads[0], "peak_rss_mib": round(peak[0]), "wall_s": round(wall, 1),
            "log": os.path.join(out, "server.log")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meshtrain", default=os.path.join(ROOT, "build", "bin", "meshtrain"))
    parser.add_argument("--clients", default="100,1000")
    parser.add_argument("--per-round", default="100,1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="exit 1 unless every round is ok on < 64 server threads")
    parser.add_argument("--model", default="--model.preset=tiny --model.layers=1 --model.width=64 --model.heads=2 "
                        "--model.context=64", help="server flags that choose the model (its size sets the bytes)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="fl_scale_")
    pb, pb_grpc = stubs(work)
    results = []
    print("| clients joined | per round | rounds ok | s per round (median) | MB per round | server threads (max) | server peak RSS MiB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for count in [int(c) for c in args.clients.split(",")]:
        for per_round in [int(k) for k in args.per_round.split(",") if int(k) <= count]:
            r = run(args.meshtrain, pb, pb_grpc, work, count, per_round, args.rounds, args.model.split())
            results.append(r)
            print(f"| {count:,} | {per_round:,} | {r['rounds_ok']}/{args.rounds} | {r['seconds_per_round']:.2f} | "
                  f"{r['bytes_per_round'] / 1e6:,.1f} | {r['server_threads']} | {r['peak_rss_mib']} |", flush=True)
    with open(os.path.join(work, "scale.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"results: {work}/scale.json")
    if args.check:
        bad = [r for r in results if r["rounds_ok"] != args.rounds or r["server_threads"] >= 64]
        shutil.rmtree(work, ignore_errors=True)
        if bad:
            print(f"FAIL: {bad}")
            sys.exit(1)
        print("ok: every round took its target's results; the server's threads stayed below 64")


if __name__ == "__main__":
    main()
