"""Hostile clients against `meshtrain fl server`, over gRPC with real processes.

Four honest `meshtrain fl client` processes (one speaking role of the test
excerpt each) and one attacker written here in Python from stubs that
grpc_tools generates from meshtrain/fl/federation.proto, as anyone could:
- huge: finite values of 1e30 claiming 2^62 examples;
- signflip: minus ten times the global model's last change;
- bigmsg: one 900 MiB update, sent four ways (its size declared, a small size
  declared, as one chunk, and as version 1's whole-message Submit).
With the defaults (FedAvg's mean; examples capped at what the client declared
at Join; norms clipped to 3x the round's median; a message cap from the model)
the validation loss stays finite and within MEAN_MARGIN of the attack-free
run; under Krum and the trimmed mean within ROBUST_MARGIN. The 900 MiB update
is refused each way, at its first chunk past the cap (Note [Messages in
chunks]), the server's peak memory barely moves, and the round goes on without
it. With the
bounds off a 1e30 round is
rolled back: state.safetensors keeps the last good round and a restarted
server resumes from it. An id that is live cannot be taken by another Join,
bytes that are no message get INVALID_ARGUMENT by name, and the accountant
equals Opacus's on the same orders.

usage: attack_test.py MESHTRAIN
"""
import os
import shutil
import sys
import tempfile
import threading

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
from checks import Checks  # noqa: E402
from hostile import Attacker, Federation as Run, stubs  # noqa: E402

MESHTRAIN = sys.argv[1]
os.environ["OMP_NUM_THREADS"] = "1"  # six processes on a small machine: no spinning thread pools
CHECKS = Checks(MESHTRAIN)
check = CHECKS.check
EXCERPT = os.path.join(HERE, "..", "data", "shakespeare_excerpt.txt")
HONEST = ["MENENIUS", "MARCIUS", "COMINIUS", "VOLUMNIA"]
ROUNDS = 8
# Final validation loss, attacked run against the attack-free one (which learns 5.56 -> 3.25).
MEAN_MARGIN = 0.6    # FedAvg's mean with the default bounds: measured 0.35 (sign flip) and 0.46 (1e30)
ROBUST_MARGIN = 0.15  # Krum, trimmed mean: measured 0.03 to 0.07
MODEL = ["--model.layers=1", "--model.width=32", "--model.heads=2", "--model.context=32"]
FL = ["--fl.client.local_steps=5", "--fl.client.batch=8", "--fl.client.lr=0.5", "--fl.deadline_s=60",
      "--fl.wait_clients_s=60", "--fl.data.eval_batches=8", "--fl.server.insecure=true"]


def Federation(work, name, overrides=(), clients=HONEST, extra_available=0, rounds=ROUNDS, fresh=True):
    return Run(MESHTRAIN, work, name, clients, MODEL + FL + list(overrides), extra_available, rounds, fresh)


def final_val(rows):
    return rows[-1]["val_loss"]


def attacked(work, pb, pb_grpc, name, kind, overrides=(), attack_rounds=None):
    fed = Federation(work, name, overrides, extra_available=1)
    attacker = Attacker(pb, pb_grpc, fed.port, kind, fed.server.pid, attack_rounds=attack_rounds)
    attacker.start()
    rows = fed.finish()
    attacker.join(timeout=60)
    return fed, rows, attacker


def malformed_and_duplicate(pb, pb_grpc, fed):
    """An impostor's Join of a live id, and bytes that are no message, against a running federation."""
    channel = grpc.insecure_channel(f"127.0.0.1:{fed.port}")
    stub = pb_grpc.FederationStub(channel)
    fed.wait_joined(len(HONEST))
    try:
        stub.Join(pb.JoinRequest(client_id=HONEST[0], examples=100, protocol=2), timeout=10)
        check(False, "a Join with a live client's id is refused")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.ALREADY_EXISTS and "live session" in e.details(),
              f"a Join with a live client's id is refused: {e.code().name}: {e.details()}")
    raw = channel.stream_unary("/meshtrain.fl.wire.Federation/SubmitChunks", request_serializer=None,
                               response_deserializer=None)
    try:
        raw(iter([b"\xff\xff\xff\xff\x0f not a message"]), timeout=10)
        check(False, "bytes that are no message are refused")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "meshtrain.fl.wire.Chunk" in e.details(),
              f"bytes that are no message: {e.code().name}: {e.details()}")
    try:
        stub.Join(pb.JoinRequest(client_id="old", examples=100), timeout=10)
        check(False, "a version 1 client is refused at Join")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.PERMISSION_DENIED and "protocol 2" in e.details(),
              f"a version 1 client is refused at Join: {e.code().name}: {e.details()}")


def main():
    work = tempfile.mkdtemp(prefix="fl_attack_")
    try:
        pb, pb_grpc = stubs(work)
        CHECKS.meshtrain("fl", "split", EXCERPT, "--out", f"{work}/speakers", "--min-bytes", "1000")

        fed = Federation(work, "free", ["--fl.wait_clients_s=5"])
        probe = threading.Thread(target=malformed_and_duplicate, args=(pb, pb_grpc, fed))
        probe.start()
        free = fed.finish()
        probe.join()
        base = final_val(free)
        free_rss = fed.peak_rss
        print(f"attack-free: validation loss {free[0]['val_loss']:.4f} -> {base:.4f}", flush=True)
        check(all(r["status"] == "ok" for r in free[1:]) and all(len(r["participants"]) == 4 for r in free[1:]),
              "attack-free: every round ok with the 4 honest clients (the impostor took no session)")
        check(base < free[0]["val_loss"] - 3 * MEAN_MARGIN, "attack-free: the federation learns, by far more than the margins")
        check("claims" not in fed.server_log(),
              "attack-free: no honest client is said to over-claim (its Join declares tokens, counted at the model's context)")

        cases = [("huge", "mean", []), ("signflip", "mean", []), ("signflip", "krum", ["--fl.aggregation=krum"]),
                 ("huge", "trimmed_mean", ["--fl.aggregation=trimmed_mean", "--fl.trim_fraction=0.2"])]
        for kind, rule, overrides in cases:
            fed, rows, attacker = attacked(work, pb, pb_grpc, f"{kind}_{rule}", kind, overrides)
            vals = [r["val_loss"] for r in rows]
            final = final_val(rows)
            print(f"{kind} attacker, {rule}: validation loss {vals[0]:.4f} -> {final:.4f} "
                  f"(attack-free {base:.4f})", flush=True)
            check(all(v is not None and np.isfinite(v) for v in vals), f"{kind}, {rule}: the validation loss stays finite")
            margin = MEAN_MARGIN if rule == "mean" else ROBUST_MARGIN
            check(abs(final - base) <= margin, f"{kind}, {rule}: final validation loss {final:.4f} within {margin} of "
                  f"the attack-free {base:.4f}")
            if kind == "huge" and rule == "mean":
                check("counted as 300" in fed.server_log(), "huge: 2^62 examples counted as the 300 declared at Join")
                check(all("mallory" in r["clipped"] for r in rows[1:]), "huge: its update clipped every round")

        # The 900 MiB update in round 2 only: that round waits out its deadline for it (10 s), the rest do not.
        quota = 64  # MiB of gRPC's buffers: what a message sent whole, past the protocol, may cost
        fed, rows, attacker = attacked(work, pb, pb_grpc, "bigmsg_mean", "bigmsg",
                                       ["--fl.deadline_s=10", f"--fl.server.grpc_memory_mb={quota}"], {2})
        big = [s for s in attacker.statuses if s[0] == 2]
        for _, how, code, details, seconds, rss in big:
            print(f"900 MiB update, {how}: {code} after {seconds:.2f} s ({details}); server peak RSS {rss:.0f} MiB",
                  flush=True)
        print(f"server peak RSS {fed.peak_rss:.0f} MiB against {free_rss:.0f} MiB without them", flush=True)
        codes = {how: code for _, how, code, _, _, _ in big}
        check(codes == {"declared": "RESOURCE_EXHAUSTED", "lying": "RESOURCE_EXHAUSTED",
                        "one chunk": "RESOURCE_EXHAUSTED", "version 1": "FAILED_PRECONDITION"},
              f"900 MiB: refused as too large, or as version 1's call ({codes})")
        rss = {how: peak for _, how, _, _, _, peak in big}
        check(rss["lying"] <= free_rss + 16, f"900 MiB in chunks: the server's peak RSS {rss['lying']:.0f} MiB within "
              f"16 MiB of the attack-free {free_rss:.0f} MiB (Note [Messages in chunks])")
        # gRPC's quota is soft: its reclaimer cuts the stream off a moment after the quota is passed, and
        # the bytes that arrive meanwhile depend on the load: +65 to +89 MiB over the attack-free peak in
        # five runs on a quiet machine, +142 in one under the whole suite on 2 cores. Buffered whole, the
        # message would cost 900 MiB or more (protocol 1's took +860).
        check(fed.peak_rss <= free_rss + 4 * quota, f"900 MiB sent whole: the server's peak RSS {fed.peak_rss:.0f} MiB "
              f"within four times fl.server.grpc_memory_mb = {quota} of the attack-free {free_rss:.0f} MiB "
              "(cut off, not buffered)")
        check(rows[2]["status"] == "ok" and rows[2]["dropped"] == ["mallory"] and len(rows[2]["participants"]) == 4,
              "900 MiB: round 2 ends with the 4 honest updates")
        check(all(r["status"] == "ok" for r in rows[1:]), "900 MiB: every round ok")
        check(abs(final_val(rows) - base) <= MEAN_MARGIN, f"900 MiB: final validation loss {final_val(rows):.4f} "
              f"within {MEAN_MARGIN} of the attack-free run")

        rollback(work, pb, pb_grpc)
        accountant()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    CHECKS.finish()


def rollback(work, pb, pb_grpc):
    """Bounds off, 1e30 in round 2 only: the round is undone and never saved; a restart resumes from round 1."""
    fed = Federation(work, "rollback", ["--fl.clip_norm=0"], extra_available=1, rounds=2)
    state = os.path.join(fed.out, "state.safetensors")
    seen = {}
    attacker = Attacker(pb, pb_grpc, fed.port, "huge", fed.server.pid, attack_rounds={2})
    attacker.on_round = lambda r: seen.setdefault(r, open(state, "rb").read() if r == 2 else None)
    attacker.start()
    rows = fed.finish()
    attacker.join(timeout=60)
    check(rows[2]["status"] == "rolled_back" and "validation loss" in rows[2].get("error", ""),
          f"rollback: the 1e30 round is rolled back ({rows[2].get('error')})")
    check(rows[2]["val_loss"] == rows[1]["val_loss"], "rollback: the model after it is the model before it")
    with open(state, "rb") as f:
        check(f.read() == seen.get(2), "rollback: state.safetensors is byte for byte the state of round 1")
    check(os.path.exists(os.path.join(fed.out, "states", "round-1.safetensors")), "rollback: round 1 kept in states/")
    again = Federation(work, "rollback", [], rounds=3, fresh=False)
    rows = again.finish()
    log = again.server_log()
    check("resumed from" in log and "after round 1" in log, "rollback: a restarted server resumes after round 1")
    check([r["round"] for r in rows[-2:]] == [2, 3] and all(r["status"] == "ok" for r in rows[-2:]),
          "rollback: rounds 2 and 3 run again, ok, without the attacker")


def accountant():
    """`meshtrain fl privacy` against Opacus's RDP accountant on the same integer orders."""
    from opacus.accountants.analysis import rdp
    orders = list(range(2, 257))
    for q, z, rounds in [(1.0, 1.1, 20), (0.1, 1.0, 100), (0.01, 0.8, 1000), (0.05, 2.0, 500)]:
        reference, _ = rdp.get_privacy_spent(orders=orders, rdp=rdp.compute_rdp(q=q, noise_multiplier=z, steps=rounds,
                                                                                orders=orders), delta=1e-5)
        out = CHECKS.meshtrain("fl", "privacy", "--fraction", str(q), "--noise-multiplier", str(z), "--rounds",
                               str(rounds), "--delta", "1e-5")
        ours = float(out.split("=")[1].split()[0])
        check(abs(ours - reference) <= 1e-4 * max(1, reference),
              f"privacy: q {q}, z {z}, {rounds} rounds: epsilon {ours:.5f}, Opacus {reference:.5f}")


if __name__ == "__main__":
    main()
