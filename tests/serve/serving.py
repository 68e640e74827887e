"""What the serving tests share: a `meshtrain serve` process, the text
`meshtrain generate` gives offline, and raw HTTP posts."""
import functools
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request

import openai


class Server:
    def __init__(self, meshtrain, checkpoint, *extra, ranks=1, launch=False, env=None):
        """`launch`: through `meshtrain run` even on one rank."""
        prefix = [meshtrain] if ranks == 1 and not launch else [meshtrain, "run", "-n", str(ranks)]
        tp = [] if ranks == 1 else [f"--parallel.tp={ranks}"]
        self.proc = subprocess.Popen(prefix + ["serve", "--checkpoint", checkpoint, "--port", "0", *tp, *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.time() + 120
        self.banner = []  # what the server printed up to its address
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            self.banner.append(line)
            found = re.search(r"(https?)://127\.0\.0\.1:(\d+)", line or "")
            if found:
                self.port = int(found.group(2))
                self.url = f"{found.group(1)}://127.0.0.1:{self.port}"
                return
            if self.proc.poll() is not None:
                break
        raise RuntimeError("the server did not start: " + self.proc.stderr.read())

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=120)
        if code != 0:
            print(f"the server exited with status {code}:\n{self.proc.stderr.read()}", flush=True)
        return code


def offline(meshtrain, checkpoint, prompt, max_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=0, stop=()):
    """The text `meshtrain generate` continues `prompt` with: the oracle of the serving tests."""
    return _offline(meshtrain, checkpoint, _checkpoint_identity(checkpoint), prompt, max_tokens, temperature, top_k,
                    top_p, seed, tuple(stop))


def _checkpoint_identity(checkpoint):
    """What the checkpoint folder holds now (its files, sizes and times): a new save is another oracle."""
    found = []
    for folder, _, files in os.walk(checkpoint):
        for name in files:
            info = os.stat(os.path.join(folder, name))
            found.append((os.path.relpath(os.path.join(folder, name), checkpoint), info.st_size, info.st_mtime_ns))
    return tuple(sorted(found))


# Generation is deterministic for a checkpoint, prompt, settings and seed: each is run once per test.
@functools.lru_cache(maxsize=None)
def _offline(meshtrain, checkpoint, identity, prompt, max_tokens, temperature, top_k, top_p, seed, stop):
    args = [meshtrain, "generate", "--checkpoint", checkpoint, "--prompt", prompt, "--tokens", str(max_tokens),
            "--temperature", str(temperature), "--top-k", str(top_k), "--top-p", str(top_p), "--seed", str(seed)]
    for s in stop:
        args += ["--stop", s]
    out = subprocess.run(args, check=True, capture_output=True).stdout.decode("utf-8", "replace")
    assert out.startswith(prompt) and out.endswith("\n"), out
    return out[len(prompt):-1]


def post(url, body, raw=None, path="/v1/completions", timeout=120):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
