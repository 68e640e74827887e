"""One bad request, client or connection never takes `meshtrain serve` down
(Note [Safe sampling], Note [Admission], Note [TLS]): each hostile case, then normal
requests that must still get offline generation's tokens.

usage: hostile_test.py MESHTRAIN CHECKPOINT
CHECKPOINT: a model whose vocabulary (300) is larger than its byte tokenizer's
(256), as published models pad theirs, with a long context.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import httpx2 as httpx  # the HTTP client the pinned openai takes
import openai

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
import serving  # noqa: E402

MESHTRAIN, CHECKPOINT = sys.argv[1], sys.argv[2]
CHECKS = Checks(MESHTRAIN)
check = CHECKS.check


def offline(prompt, max_tokens, temperature=1.0, seed=0):
    return serving.offline(MESHTRAIN, CHECKPOINT, prompt, max_tokens, temperature, 0, 1.0, seed)


def alive_and_right(server, what):
    """Normal requests still get offline generation's tokens."""
    for prompt, n, t, seed in [("The ", 30, 0.0, 1), ("To be", 40, 0.9, 7)]:
        code, body = serving.post(server.url, {"prompt": prompt, "max_tokens": n, "temperature": t, "seed": seed,
                                               "top_k": 0})
        ok = code == 200 and body["choices"][0]["text"] == offline(prompt, n, t, seed)
        check(ok, f"after {what}: a normal request gets offline generation's text ({code})")


def padded_vocabulary_and_extreme_sampling(server):
    codes = [serving.post(server.url, {"prompt": "The ", "max_tokens": 200, "temperature": 2.0, "seed": s})[0]
             for s in range(12)]
    check(codes == [200] * 12, f"a padded vocabulary: 12 hot completions never sample an id the tokenizer lacks ({codes})")
    greedy = serving.post(server.url, {"prompt": "The ", "max_tokens": 20, "temperature": 0})[1]["choices"][0]["text"]
    for what, body in [("temperature 1e-38", {"temperature": 1e-38}), ("top_p 1e-46", {"top_p": 1e-46, "seed": 4})]:
        code, reply = serving.post(server.url, {"prompt": "The ", "max_tokens": 20, **body})
        check(code == 200 and reply["choices"][0]["text"] == greedy, f"{what} answers the greedy text ({code})")
    for what, raw in [("temperature 1e999", b'{"prompt": "x", "temperature": 1e999}'),
                      ("a temperature of infinity's spelling", b'{"prompt": "x", "temperature": "inf"}')]:
        code, reply = serving.post(server.url, None, raw=raw)
        message = reply.get("error", {}).get("message", "")
        check(code == 400 and ("temperature" in message or "1e999" in message),
              f"{what}: 400 naming the field or the number ({code} {message!r})")
        check("Exception raised from" not in json.dumps(reply) and "frame #" not in json.dumps(reply),
              f"{what}: no C++ internals in the reply")
    alive_and_right(server, "padded-vocabulary sampling and extreme settings")


def send_chunked(port, total, path="/v1/completions", method="POST", chunk=1 << 20):
    """Sends `total` bytes of chunked body; the server's status line ("" when it sent none)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              "Transfer-Encoding: chunked\r\n\r\n".encode())
    sent, piece = 0, b"%x\r\n" % chunk + b" " * chunk + b"\r\n"
    try:
        while sent < total:
            s.sendall(piece)
            sent += chunk
        s.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the server stopped reading: what it should do past the limit
    try:
        reply = s.recv(4096).decode(errors="replace")
    except OSError:
        reply = ""
    s.close()
    return reply.split("\r\n")[0]


def rss_mib(pid, field="VmHWM"):
    """The process's peak (VmHWM) or current (VmRSS) resident memory."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0


def bodies_are_held_to_the_limit(server):
    before, resident = rss_mib(server.proc.pid), rss_mib(server.proc.pid, "VmRSS")
    for method, path, status in [("POST", "/v1/completions", " 413 "), ("POST", "/v1/chat/completions", " 413 "),
                                 ("POST", "/v1/embeddings", " 40"), ("GET", "/v1/models", None)]:
        line = send_chunked(server.port, 100 << 20, path, method)
        if status:  # a GET's body is not read at all: only the memory counts
            check(status in line, f"a 100 MB chunked body to {method} {path} is refused ({line!r})")
    grown = rss_mib(server.proc.pid) - before
    check(grown < 64, f"the server's peak memory grew {grown:.0f} MiB for four of them (under 64)")
    kept = rss_mib(server.proc.pid, "VmRSS") - resident
    check(kept < 16, f"... and it kept {kept:.0f} MiB of it (under 16: Note [Request memory])")
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n")
    reply = s.recv(4096).decode(errors="replace")
    s.close()
    check(" 413 " in reply.split("\r\n")[0], f"a declared 100 MB body is refused before it is read ({reply[:40]!r})")
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 104857600\r\n\r\n")
    reply = s.recv(4096).decode(errors="replace")
    s.close()
    check(" 413 " in reply.split("\r\n")[0], f"... and with Expect: 100-continue, a 413 instead of a 100 ({reply[:40]!r})")
    body = json.dumps({"prompt": "The ", "max_tokens": 30, "temperature": 0, "seed": 1, "top_k": 0}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n")
    interim = s.recv(4096).decode(errors="replace")
    s.sendall(body)
    answer = b""
    while not answer.endswith(b"}") and (piece := s.recv(65536)):
        answer += piece
    s.close()
    text = answer.decode(errors="replace")
    check(interim.startswith("HTTP/1.1 100 ") and "HTTP/1.1 200 " in text
          and json.loads(text[text.index("{"):])["choices"][0]["text"] == offline("The ", 30, 0.0, 1),
          f"a body within the limit sent after a 100 Continue gets its answer ({interim[:25]!r})")
    alive_and_right(server, "oversized bodies")


def many_large_bodies_at_once(server, clients=24):
    """More 7 MiB bodies at once than the budget for bodies being received holds (Note [Admission]): those
    past it wait their turn, none is starved into a timeout, and each gets its answer."""
    body = json.dumps({"prompt": "x" * (7 << 20), "max_tokens": 1}).encode()
    codes = [None] * clients

    def send(i):
        try:
            codes[i] = serving.post(server.url, None, raw=body, timeout=60)[0]
        except OSError as e:
            codes[i] = str(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(clients)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(codes == [400] * clients, f"{clients} bodies of 7 MiB at once ({clients * 7} MiB, budget 128 MiB) are "
          f"all read and answered (400: past the context) in {time.time() - start:.1f} s ({sorted(set(map(str, codes)))})")
    alive_and_right(server, "many large bodies")


def slow_clients_cannot_lock_others_out(server, clients=200):
    stop = threading.Event()
    sockets = []
    for i in range(clients):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sockets.append(s)

    def drip():
        # A third send their headers a byte a second, a third their whole head at once and then their
        # body a byte a second; the rest stay idle, sending nothing at all.
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
        for i, s in enumerate(sockets):
            if i % 3 == 1:
                s.sendall(head + b"\r\n")
        for k in range(len(head)):
            if stop.is_set():
                return
            for i, s in enumerate(sockets):
                try:
                    if i % 3 == 0:
                        s.send(head[k:k + 1])
                    elif i % 3 == 1:
                        s.send(b" ")
                except OSError:
                    pass
            stop.wait(1.0)

    dripper = threading.Thread(target=drip)
    dripper.start()
    time.sleep(1.5)
    latencies = []
    for i in range(6):
        start = time.time()
        try:
            code, _ = serving.post(server.url, {"prompt": "The ", "max_tokens": 8, "temperature": 0}, timeout=10)
        except OSError as e:  # timed out: locked out
            code = str(e)
        latencies.append((code, time.time() - start))
    stop.set()
    dripper.join()
    for s in sockets:
        s.close()
    worst = max(t for _, t in latencies)
    check(all(c == 200 for c, _ in latencies) and worst < 2.0,
          f"with {clients} slow (head or body) or idle clients connected, a normal client gets answers "
          f"(slowest of 6 {worst:.2f} s, median {sorted(t for _, t in latencies)[3]:.2f} s)")
    alive_and_right(server, "slow clients")


def a_client_that_leaves_is_cancelled(server):
    """A non-streaming request whose client disconnects: the server notices and stops (499 in its log)."""
    body = json.dumps({"prompt": "The ", "max_tokens": 2000, "temperature": 1.0, "seed": 1}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(0.3)
    s.close()
    alive_and_right(server, "a client that left")


def a_forward_that_fails_fails_its_requests_alone(limit_mib, ranks=1):
    """A scoring request too large for the memory limit fails alone (Note [Forward failures]): a generation
    running beside it ends with offline generation's text, and the server goes on; under tensor parallel
    every rank fails the same forward and goes on alike."""
    server = serving.Server(MESHTRAIN, CHECKPOINT, "--memory.limit_mb", str(limit_mib), ranks=ranks)
    result = {}

    def generate():
        result["reply"] = serving.post(server.url, {"prompt": "To be", "max_tokens": 300, "temperature": 0.9,
                                                    "seed": 7, "top_k": 0})

    running = threading.Thread(target=generate)
    running.start()
    time.sleep(0.5)
    huge = {"prompt": ["Now is the winter of our discontent " * 50] * 12, "max_tokens": 0, "echo": True, "logprobs": 5}
    code, reply = serving.post(server.url, huge)
    message = reply.get("error", {}).get("message", "")
    check(code == 500 and "out of memory" in message and "frame #" not in message,
          f"{ranks} rank(s): a prefill past memory.limit_mb={limit_mib} fails that request: 500 "
          f"({code} {message[:160]!r})")
    running.join()
    code, body = result["reply"]
    check(code == 200 and body["choices"][0]["text"] == offline("To be", 300, 0.9, 7),
          f"the generation running beside it ends with offline generation's text ({code})")
    alive_and_right(server, "a forward that ran out of memory")
    check(server.stop() == 0, f"{ranks} rank(s): the server with a memory limit exits 0 after SIGTERM")


def an_api_key_guards_the_model_routes():
    """--api-key (Note [API key]): 401 on /v1 without the key or with another, /health and /tokenize open, the openai client with the
    key served; the key appears in no output, though the launcher prints the command line."""
    key = "sk-local-" + os.urandom(8).hex()
    server = serving.Server(MESHTRAIN, CHECKPOINT, "--log", "--api-key", key, launch=True)
    body = json.dumps({"prompt": "The ", "max_tokens": 4, "temperature": 0}).encode()

    def status(path, headers, data=None):
        req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    for path, data in (("/v1/completions", body), ("/v1/chat/completions", body), ("/v1/models", None)):
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": key}):
            code, reply = status(path, headers, data)
            check(code == 401 and reply.get("error", {}).get("param") == "api_key",
                  f"{path} with {sorted(headers) or 'no headers'}{' (the key without Bearer)' if headers.get('Authorization') == key else ''}: 401 ({code})")
    check(status("/health", {})[0] == 200, "/health answers without the key")
    check(status("/tokenize", {}, json.dumps({"prompt": "The "}).encode())[0] == 200,
          "/tokenize (the tokenizer's, outside /v1, as vLLM) answers without the key")
    check(status("/v1/models", {"Authorization": "Bearer " + key})[0] == 200, "/v1/models answers with the key")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
    text = client.completions.create(model="meshtrain", prompt="The ", max_tokens=4, temperature=0).choices[0].text
    check(text == offline("The ", 4, 0.0, 0), f"the openai client with the key is served ({text!r})")
    try:
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=60).models.list()
        check(False, "the openai client with another key was served")
    except openai.AuthenticationError:
        check(True, "the openai client with another key gets AuthenticationError")
    check(server.stop() == 0, "the server with a key exits 0 after SIGTERM")
    output = server.proc.stdout.read() + server.proc.stderr.read()
    check(key not in output and "--api-key ***" in output,
          "the key is in no output (the launcher's command line shows --api-key ***)")


def https_with_a_certificate():
    """--ssl-certfile/--ssl-keyfile (Note [TLS]): the openai client over HTTPS, trusting the certificate and sending
    the key, gets offline generation's tokens, streamed too; a client that does not trust it is refused; plain HTTP,
    a connection that never begins its handshake and one that stops mid-way hold nothing; bodies keep their bound."""
    work = tempfile.mkdtemp()
    cert, key = f"{work}/server.crt", f"{work}/server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    api_key = "sk-local-" + os.urandom(8).hex()
    server = serving.Server(MESHTRAIN, CHECKPOINT, "--ssl-certfile", cert, "--ssl-keyfile", key, "--api-key", api_key)
    check(server.url.startswith("https://"), f"the server says it serves HTTPS ({server.url})")
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(50)]  # no handshake begun
    half = socket.create_connection(("127.0.0.1", server.port))
    half.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello cut short
    plain = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    plain.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    try:
        answer = plain.recv(64)
    except ConnectionResetError:
        answer = b""
    check(not answer.startswith(b"HTTP/"), f"plain HTTP on the TLS port gets no HTTP answer ({answer[:12]!r})")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60,
                           http_client=httpx.Client(verify=cert))
    text = client.completions.create(model="meshtrain", prompt="The ", max_tokens=4, temperature=0).choices[0].text
    check(text == offline("The ", 4, 0.0, 0), f"the openai client over HTTPS is served ({text!r})")
    pieces = client.completions.create(model="meshtrain", prompt="The ", max_tokens=6, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in pieces if chunk.choices)
    check(streamed == offline("The ", 6, 0.0, 0), f"a stream over HTTPS carries the same tokens ({streamed!r})")
    try:
        openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=30).models.list()
        check(False, "a client that does not trust the certificate was served")
    except openai.APIConnectionError:
        check(True, "a client that does not trust the certificate cannot connect")
    with httpx.Client(verify=cert, timeout=60) as http:
        big = http.post(server.url + "/v1/completions", content=b"x" * (9 << 20),
                        headers={"Authorization": "Bearer " + api_key, "Content-Type": "application/json"})
        check(big.status_code == 413, f"a 9 MiB body over HTTPS gets 413 ({big.status_code})")
        check(http.get(server.url + "/v1/models").status_code == 401, "without the key: 401 over HTTPS")
    for s in idle + [half, plain]:
        s.close()
    text = client.completions.create(model="meshtrain", prompt="The ", max_tokens=4, temperature=0).choices[0].text
    check(text == offline("The ", 4, 0.0, 0), "after the hostile connections the openai client is still served")
    check(server.stop() == 0, "the HTTPS server exits 0 after SIGTERM")
    shutil.rmtree(work)


def main():
    an_api_key_guards_the_model_routes()
    https_with_a_certificate()
    server = serving.Server(MESHTRAIN, CHECKPOINT, "--log", "--max-batch", "2")
    padded_vocabulary_and_extreme_sampling(server)
    bodies_are_held_to_the_limit(server)
    many_large_bodies_at_once(server)
    slow_clients_cannot_lock_others_out(server)
    a_client_that_leaves_is_cancelled(server)
    check(server.stop() == 0, "the server exits 0 after SIGTERM")
    a_forward_that_fails_fails_its_requests_alone(48)
    log = server.proc.stderr.read()
    check(" 499" in log, "the request whose client left was cancelled (499 in the log)")
    check(re.search(r"^meshtrain serve: 127\.0\.0\.1:\d+ (GET|POST) /\S* \d{3}$", log, re.M) is not None,
          "the request log names each client's address and port")
    split = serving.Server(MESHTRAIN, CHECKPOINT, ranks=2)  # tensor parallel: every rank samples alike
    padded_vocabulary_and_extreme_sampling(split)
    check(split.stop() == 0, "the tensor-parallel server exits 0 after SIGTERM")
    a_forward_that_fails_fails_its_requests_alone(40, ranks=2)
    CHECKS.finish()


if __name__ == "__main__":
    main()
