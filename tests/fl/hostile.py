"""A federated client written from federation.proto's stubs, as anyone could
write one, that attacks; and a `meshtrain fl server` with honest `meshtrain fl
client` processes on loopback. Shared by tests/fl/attack_test.py and
bench/fl_robust_vs_flower.py."""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
from grpc_tools import protoc

PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "meshtrain", "fl")
U64 = (1 << 64) - 1


def stubs(work):
    """federation_pb2 and federation_pb2_grpc, generated from the .proto the server serves."""
    if protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={work}", f"--grpc_python_out={work}",
                    os.path.join(PROTO_DIR, "federation.proto")]) != 0:
        raise RuntimeError("grpc_tools.protoc failed on federation.proto")
    sys.path.insert(0, work)
    import federation_pb2
    import federation_pb2_grpc
    return federation_pb2, federation_pb2_grpc


def mix_seed(a, b):  # the protocol's splitmix64 (codec.h)
    z = (a + 0x9E3779B97F4A7C15 * (b + 1)) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def fnv1a(text):
    h = 1469598103934665603
    for c in text.encode():
        h = ((h ^ c) * 1099511628211) & U64
    return h


def sketch_seed(round_seed, index, client_id):  # update.h: a client's own seeds
    return mix_seed(mix_seed(mix_seed(round_seed, 0x534B), index), fnv1a(client_id))


CHUNK = 1 << 20  # federation.proto: a Task or a Result travels in pieces of at most 1 MiB
PROTOCOL = 2


def chunks(data, pb, client_id="", session="", total=None, round=0, kind=0):
    """`data`, serialized, as the protocol's Chunk stream; `total` may lie; `round` and `kind` name what a result
    answers (0: not said)."""
    yield pb.Chunk(data=data[:CHUNK], total=len(data) if total is None else total, client_id=client_id, session=session,
                   round=round, kind=kind)
    for at in range(CHUNK, len(data), CHUNK):
        yield pb.Chunk(data=data[at:at + CHUNK])


def poll(stub, pb, request, timeout):
    task = pb.Task()
    task.ParseFromString(b"".join(c.data for c in stub.PollChunks(request, timeout=timeout)))
    return task


def submit(stub, pb, result, timeout):
    return stub.SubmitChunks(chunks(result.SerializeToString(), pb, result.client_id, result.session,
                                    round=result.round, kind=result.kind), timeout=timeout)


def peak_rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Attacker(threading.Thread):
    """Joins as `name`, then answers every FIT with its attack until STOP."""

    def __init__(self, pb, pb_grpc, port, kind, server_pid, name="mallory", declared=300, attack_rounds=None):
        super().__init__(daemon=True)
        self.pb, self.kind, self.name, self.declared = pb, kind, name, declared
        self.server_pid, self.attack_rounds = server_pid, attack_rounds
        options = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
        self.stub = pb_grpc.FederationStub(self.channel)
        self.previous = None
        self.statuses = []  # (round, how it was sent, status code name, message, seconds, server's peak RSS after)
        self.peak_rss = 0.0
        self.on_round = None  # called with the round number before the attack is sent

    def run(self):
        pb = self.pb
        session = self.stub.Join(pb.JoinRequest(client_id=self.name, examples=self.declared, protocol=PROTOCOL),
                                 wait_for_ready=True, timeout=60).session
        while True:
            task = poll(self.stub, pb, pb.PollRequest(client_id=self.name, session=session), timeout=30)
            if task.kind == pb.Task.STOP:
                return
            if task.kind != pb.Task.FIT:
                continue
            if self.on_round:
                self.on_round(task.round)
            weights = [np.frombuffer(t.data, np.float32).reshape(tuple(t.shape)) for t in task.weights]
            result = pb.Result(client_id=self.name, session=session, round=task.round, kind=pb.Task.FIT,
                               examples=self.declared, train_loss=1.0)
            attacking = self.attack_rounds is None or task.round in self.attack_rounds
            if self.kind == "bigmsg" and attacking:
                self.big(result, task)
            else:
                self.fill(result, task, weights, attacking)
                self.send(task.round, "", lambda: submit(self.stub, pb, result, timeout=120))
            self.previous = weights

    def send(self, round, how, call):
        start = time.time()
        try:
            call()
            code, details = "OK", ""
        except grpc.RpcError as e:
            code, details = e.code().name, e.details()
        self.peak_rss = max(self.peak_rss, peak_rss_mib(self.server_pid) or 0)
        self.statuses.append((round, how, code, details, time.time() - start, self.peak_rss))

    def big(self, result, task):
        """A 900 MiB update sent four ways: its size declared; 1.5 MiB declared, then all of it; as one chunk; and
        as version 1's whole-message Submit."""
        pb = self.pb
        result.update.add(index=0, seed=sketch_seed(task.fit.seed, 0, self.name), length=(900 << 20) // 4,
                          values=bytes(900 << 20))
        data = result.SerializeToString()
        result.ClearField("update")
        id, session = result.client_id, result.session
        self.send(task.round, "declared", lambda: self.stub.SubmitChunks(chunks(data, pb, id, session), timeout=120))
        self.send(task.round, "lying", lambda: self.stub.SubmitChunks(
            chunks(data, pb, id, session, total=CHUNK + CHUNK // 2), timeout=120))
        self.send(task.round, "one chunk", lambda: self.stub.SubmitChunks(
            iter([pb.Chunk(data=data, total=len(data), client_id=id, session=session)]), timeout=120))
        self.send(task.round, "version 1", lambda: self.stub.Submit(pb.Result.FromString(data), timeout=120))

    def fill(self, result, task, weights, attacking):
        seed = task.fit.seed
        for i, w in enumerate(weights):
            if not attacking:
                values = np.zeros(w.size, np.float32)
            elif self.kind == "huge":
                values = np.full(w.size, 1e30, np.float32)
                result.examples = 1 << 62
            elif self.kind == "signflip":
                change = w - self.previous[i] if self.previous is not None else np.zeros_like(w)
                values = (-10.0 * change).astype(np.float32).reshape(-1)
            else:
                raise ValueError(self.kind)
            result.update.add(index=i, seed=sketch_seed(seed, i, self.name), length=w.size, values=values.tobytes())


class Federation:
    """A server and the honest client processes on loopback."""

    def __init__(self, meshtrain, work, name, clients, args, extra_available=0, rounds=8, fresh=True, min_fit=3):
        """`clients`: honest client ids, each a directory of work/speakers; `args`: server flags."""
        self.out = os.path.join(work, name)
        if fresh:
            shutil.rmtree(self.out, ignore_errors=True)
        os.makedirs(self.out, exist_ok=True)
        port_file = os.path.join(self.out, "port")
        if os.path.exists(port_file):
            os.remove(port_file)
        available = len(clients) + extra_available
        self.log = open(os.path.join(self.out, "server.log"), "a")
        command = [meshtrain, "fl", "server", "--port-file", port_file, "--fl.server.listen=127.0.0.1:0",
                   f"--fl.server.out={self.out}", f"--fl.rounds={rounds}", f"--fl.min_available={available}",
                   f"--fl.min_fit={min(min_fit, available)}", f"--fl.data.val_file={work}/speakers/val.bin"]
        self.server = subprocess.Popen(command + list(args), stdout=self.log, stderr=self.log)
        for _ in range(600):
            if os.path.exists(port_file) and open(port_file).read().strip():
                break
            if self.server.poll() is not None:
                raise RuntimeError(f"the server exited: {open(os.path.join(self.out, 'server.log')).read()}")
            time.sleep(0.05)
        self.port = int(open(port_file).read())
        self.peak_rss = 0.0
        self.sampler = threading.Thread(target=self.sample_rss, daemon=True)
        self.sampler.start()
        self.clients = [subprocess.Popen([meshtrain, "fl", "client", "--server", f"127.0.0.1:{self.port}",
                                          "--insecure", "--id", c, "--data", f"{work}/speakers/{c}"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in clients]

    def sample_rss(self):
        while self.server.poll() is None:
            self.peak_rss = max(self.peak_rss, peak_rss_mib(self.server.pid) or 0)
            time.sleep(0.1)

    def wait_joined(self, count, timeout=60):
        for _ in range(int(timeout / 0.1)):
            if self.server_log().count("joined (") >= count:
                return
            time.sleep(0.1)
        raise RuntimeError(f"{count} clients did not join within {timeout} s")

    def finish(self, timeout=600):
        self.server.wait(timeout=timeout)
        for c in self.clients:
            try:
                c.wait(timeout=20)
            except subprocess.TimeoutExpired:
                c.kill()
        self.log.close()
        with open(os.path.join(self.out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]

    def server_log(self):
        with open(os.path.join(self.out, "server.log")) as f:
            return f.read()
