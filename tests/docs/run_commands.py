#!/usr/bin/env python3
"""Every command a page shows runs, in the page's order, at tiny sizes.

usage: run_commands.py MESHTRAIN REPO_ROOT [--keep-going] PAGE...

Each ```sh line and ```python block of each page runs in one scratch folder
(where `build/`, `examples/`, `tests/`, `docs/`, `scripts/` and `.venv/` lead
to the repository's), so a command finds what the commands before it made, as
a reader's would. The test scales the work down, never the command's meaning
(Note [Tiny sizes]); it runs a `serve` in the background until the next serve
or the page's end, on a free port that replaces the page's; it builds a tiny
stand-in, saved by transformers with a real tokenizer and chat template, for a
Hugging Face folder a command names as `path/to/NAME`, and files a page names
as the reader's own (READER_FILES). A command ending in a `# needs: WHAT`
comment (a GPU, hosts, Slurm, a network) is skipped with that reason (a file it
would fetch is stood in for, FETCHED), as are the set-up scripts CI runs itself,
benchmark scripts (minutes each; docs/BENCHMARKS.md keeps their results) and commands another test runs as written (RUN_BY). Every other
command must exit 0 (a server must answer /health). Prints each command with its seconds;
exits 1 naming the first that failed, with its output's last lines (with
--keep-going: every one that failed, the later commands still run).
"""
import json
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from check_commands import BINARIES, fenced_blocks, sh_lines  # noqa: E402

# Note [Tiny sizes]
# ~~~~~~~~~~~~~~~~~
# A page's command runs as written plus overrides that shrink its work: a
# training run's steps divided by 50 (at least 1, and the step a trace is asked
# of; 1 where unset), so that a later command that resumes with more steps still
# trains; two transformer blocks (one per pipeline stage where there are more)
# unless the command sets them or starts from a checkpoint; validation over one
# batch; contexts above 512 cut to 512; short samples; a trained tokenizer's
# vocabulary at most 1,000; a model vocabulary set beside a stand-in tokenizer,
# the stand-in's; a federation's rounds cut to 2 and its clients' local steps
# to 1; selfcheck's bandwidth table up to 64 KiB (every collective is still
# checked); verify's steps to 2; a benchmark's steps to one timed step on two
# blocks, its messages, files and sequences to their smallest (BENCH_SIZES).
# Everything else (the layout, the ranks, the data, the model family) is the
# page's.
SETUP_SCRIPTS = {"scripts/main.sh", "scripts/test.sh", "scripts/times.sh"}
# Commands another test of the suite runs as written; the suite does not run them twice.
RUN_BY = {"cmake --install build": "package", "cmake -S examples/": "example.train_my_model",
          "cmake --build /tmp/example": "example.train_my_model", "mpirun -np 3 /tmp/example/": "example.train_my_model",
          "ctest ": "this suite"}
# Files and folders a page names as the reader's own, made in the scratch folder before the pages run:
# text from the shipped Shakespeare excerpt, configs of the tiny model.
EXCERPT = "tests/data/shakespeare_excerpt.txt"
READER_FILES = {
    "my-run.toml": "[model]\npreset = \"tiny\"\n[training]\nbatch = 16\nmicro_batch = 2\n[parallel]\ntp = 2\n",
    "my.toml": "[model]\npreset = \"tiny\"\n[training]\nbatch = 16\nmicro_batch = 4\n[run]\nout = \"runs/my\"\n",
    "my_model.toml": "[model]\npreset = \"tiny\"\n[training]\nbatch = 16\nmicro_batch = 4\n",
    "chat.json": '[{"role": "user", "content": "Who speaks first?"}]\n',
}
READER_BOOK = "book.txt"  # the whole excerpt
READER_PARTS = ["notes/act1.txt", "notes/act2.txt", "corpus/part1.txt", "corpus/part2.jsonl", "shards/shard1.txt",
                "shards/shard2.txt"]  # each a different part of it
# A folder of the reader's machine a page names, and the scratch folder it becomes.
READER_PATHS = {"/mnt/nvme": "nvme"}
# A file a page fetches with a command that needs a network, and what stands in for it: for the
# play, the shipped excerpt 26 times over with each copy's speakers renamed ("All 2:"), so that
# the stand-in has the play's size (1.1 MB) and enough speakers for the page's client counts.
FETCHED = {"tinyshakespeare.txt": "the excerpt, renamed 26 times"}


def play_stand_in(root):
    text = (root / EXCERPT).read_text()
    return "".join(re.sub(r"^([A-Z][A-Za-z ]*):$", lambda m: m.group(1) + (f" {k + 1}" if k else "") + ":", text,
                          flags=re.M) for k in range(26))
PAGE_PORT = "8000"
STAND_IN = r"(^|[\s=])path/to/([\w.-]+)"  # a Hub model a command names: a word, or an option's value


def page_blocks(path):
    """(line number, "sh" or "python", text) of each runnable item, in page order: a ```sh line (continuations
    joined) or a whole ```python block."""
    items = [(number, "sh", command) for number, command in sh_lines(path)]
    items += [(number, "python", text) for number, text in fenced_blocks(path, "python") if text.strip()]
    return sorted(items)


def free_port():
    """A free port below the kernel's ephemeral range: one from bind(0) lies inside it, and while the page's
    commands run (minutes) the kernel may hand it to another test's outgoing connection."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, first))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return str(port)
    with socket.socket() as s:  # every draw taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def option(words, name):
    """The value of --name=value or --name value in words; None when absent."""
    for i, w in enumerate(words):
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
        if w == name and i + 1 < len(words):
            return words[i + 1]
    return None


# The benchmarks' sizes at their smallest: one timed step, the smallest messages and files.
ONE_STEP = ["--warmup-steps=0", "--steps=1"]
BENCH_SIZES = {
    "train": ONE_STEP + ["--model.layers=2"], "checkpoint": ONE_STEP + ["--model.layers=2"],
    "tp": ONE_STEP + ["--model.layers=2"], "moe": ONE_STEP + ["--model.layers=2"],
    "pp": ONE_STEP + ["--model.context=32", "--model.width=64", "--model.heads=2"],
    "graph": ONE_STEP + ["--model.layers=2"], "comm": ["--max-size=64K", "--trials=1", "--trial-seconds=0.001"],
    "offload": ["--file-mb=8", "--trials=1", "--batches=1", "--training-model=tiny"], "cp": ["--seq=256", "--steps=1"],
    "generate": ["--warmup=0", "--trials=1", "--prompt-tokens=8", "--new-tokens=4"],
}


def without(words, names):
    """words less the options named (--name=value or --name value)."""
    kept, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in names:
            skip = True
        elif w.split("=", 1)[0] not in names:
            kept.append(w)
    return kept


def scaled(words):
    """A meshtrain command's words (after the binary) with the overrides of Note [Tiny sizes]."""
    i = 0
    if words[:1] == ["run"]:  # run [launcher options] COMMAND ...
        i = 1
        while i < len(words) and words[i].startswith("-"):
            i += 1 if "=" in words[i] or words[i] in ("--restart-on-hang",) else 2
    head, command = words[:i], words[i:]
    if command[:1] == ["train"]:
        extra = []
        steps = option(command, "--training.steps")
        command = without(command, {"--training.steps"})
        at_least = int(option(command, "--run.trace_step") or 1)  # the traced step is taken
        extra.append(f"--training.steps={max(at_least, int(steps) // 50 if steps else 1)}")
        if option(command, "--model.layers") is None and option(command, "--checkpoint.init_from") is None:
            stages = int(option(command, "--parallel.pp") or 1) * int(option(command, "--parallel.virtual_stages") or 1)
            extra.append(f"--model.layers={max(2, stages)}")  # a block per pipeline stage
        context = option(command, "--model.context")
        if context and int(context) > 512:
            command = without(command, {"--model.context"}) + ["--model.context=512"]
        if option(command, "--training.sample_tokens") is None:
            extra.append("--training.sample_tokens=16")
        if option(command, "--training.eval_batches") is None:
            extra.append("--training.eval_batches=1")
        command += extra
    elif command[:2] == ["tokenizer", "train"] and int(option(command, "--vocab") or 0) > 1000:
        command = without(command, {"--vocab"}) + ["--vocab", "1000"]  # a vocabulary the sample text can fill
    elif command[:2] == ["fl", "simulate"]:
        command += ["--fl.rounds=2", "--fl.client.local_steps=1"]
    elif command[:1] == ["bench"] and command[1:2] and command[1] in BENCH_SIZES:
        sizes = BENCH_SIZES[command[1]]
        command = without(command, {w.split("=")[0] for w in sizes}) + sizes
    elif command[:1] == ["verify"] and option(command, "--steps") is None:
        command += ["--steps", "2"]
    elif command[:1] == ["selfcheck"] and option(command, "--bench-max-size") is None:
        command += ["--bench-max-size", "64K"]
    return head + command


class Page:
    def __init__(self, meshtrain, root, work):
        self.meshtrain, self.root, self.work = meshtrain, root, work
        self.port = free_port()
        self.server = None
        self.stand_ins = {}
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def stand_in(self, name):
        """A tiny model folder shaped like the Hub model NAME (Qwen2.5, Llama 3.x or Mistral Instruct)."""
        if name not in self.stand_ins:
            sys.path.insert(0, str(self.root / "tests" / "harness"))
            import hf_fixtures as fx
            fx.transformers.utils.logging.disable_progress_bar()
            out = str(self.work / "stand-ins" / name)
            corpus = self.work / "stand-ins" / "corpus.txt"
            if not corpus.exists():
                corpus.parent.mkdir(parents=True, exist_ok=True)
                fx.write_corpus(str(corpus))
            corpus = str(corpus)
            lower = name.lower()
            if "qwen" in lower:
                tok = fx.qwen2_tokenizer(corpus, out)
                fx.tiny_family_model("qwen2", out, tok, ["<|im_end|>", "<|endoftext|>"])
            elif "llama-3" in lower or "llama3" in lower:
                tok = fx.llama3_tokenizer(corpus, out)
                fx.tiny_llama(out, tok)
            elif "mistral" in lower:
                tok = fx.mistral_tokenizer(corpus, out)
                fx.tiny_family_model("mistral", out, tok, ["</s>"])
            else:  # a model the page leaves open (path/to/model): a Llama 3 shape
                tok = fx.llama3_tokenizer(corpus, out)
                fx.tiny_llama(out, tok)
            self.stand_ins[name] = out
        return self.stand_ins[name]

    def with_stand_ins(self, text):
        """text with each path/to/NAME (a word, or an option's value) replaced by its stand-in's folder."""
        return re.sub(STAND_IN, lambda m: m.group(1) + self.stand_in(m.group(2)), text)

    def shell_line(self, line):
        """The line as it runs here: the page's port replaced, meshtrain commands scaled, stand-ins named."""
        line = line.replace(f":{PAGE_PORT}", f":{self.port}")
        for path, here in READER_PATHS.items():
            line = line.replace(path, str(self.work / here))
        words = shlex.split(line, comments=True)
        background = words[-1:] == ["&"]
        words = words[:-1] if background else words
        assignments = []
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # VAR=value before the command
            assignments.append(words.pop(0))
        launcher = []
        if words[:1] in (["mpirun"], ["mpiexec"]) and any(w in BINARIES for w in words):  # mpirun -np N BINARY ...
            at = next(k for k, w in enumerate(words) if w in BINARIES)
            launcher, words = words[:at], words[at:]
        if words and words[0] in BINARIES:
            words = [words[0]] + scaled(words[1:])
            named = [name for w in words for _, name in re.findall(STAND_IN, w)]
            words = [self.with_stand_ins(w) for w in words]
            if named and option(words, "--model.vocab_size"):  # the stand-in's vocabulary, not the Hub model's
                vocab = json.loads((pathlib.Path(self.stand_in(named[0])) / "config.json").read_text())["vocab_size"]
                words = without(words, {"--model.vocab_size"}) + [f"--model.vocab_size={vocab}"]
            words = [self.port if w == PAGE_PORT and words[k - 1] == "--port" else w for k, w in enumerate(words)]
            words = [f"--port={self.port}" if w == f"--port={PAGE_PORT}" else w for w in words]
            if "serve" in words[1:]:  # serve, or run ... serve
                background = True
                if option(words, "--port") is None:
                    words += ["--port", self.port]
        if assignments and words and words[0] in BINARIES:
            words = ["env"] + assignments + words
        if launcher:
            words = ["env"] + launcher + words
        return words, background

    def stop_server(self):
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:  # what it started too (a launcher's ranks)
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
            self.server = None

    def start_server(self, words, log):
        self.stop_server()
        scheme, context = "http", None
        if certificate := option(words, "--ssl-certfile"):  # the page's own certificate, for localhost
            scheme = "https"
            context = ssl.create_default_context(cafile=str(self.work / certificate))
        self.server = subprocess.Popen(words, cwd=self.work, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.server.poll() is not None:
                return f"the server exited with {self.server.returncode} before answering /health"
            try:
                with urllib.request.urlopen(f"{scheme}://localhost:{self.port}/health", timeout=2, context=context):
                    return None
            except OSError:
                time.sleep(0.2)
        return "the server did not answer /health within 120 s"

    def run_line(self, line, log):
        """Runs a shell line in its own process group, so that a timeout ends what it started (mpirun's ranks too)."""
        proc = subprocess.Popen(line, shell=True, cwd=self.work, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                executable="/bin/bash", start_new_session=True)
        try:
            returncode = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "did not end within 300 s"
        return None if returncode == 0 else f"exited {returncode}"

    def run(self, kind, text, log_path):
        with open(log_path, "w") as log:
            if kind == "sh" and text.startswith("export "):  # the page's later commands see the variables
                done = subprocess.run(["bash", "-c", text + " && env -0"], cwd=self.work, env=self.env,
                                      capture_output=True, timeout=60)
                if done.returncode != 0:
                    log.write(done.stderr.decode(errors="replace"))
                    return f"exited {done.returncode}"
                self.env = dict(kv.split("=", 1) for kv in done.stdout.decode().split("\0") if "=" in kv)
                return None
            if kind == "python":
                code = text.replace(f":{PAGE_PORT}", f":{self.port}")
                done = subprocess.run([sys.executable, "-c", code], cwd=self.work, env=self.env, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=300)
                return None if done.returncode == 0 else f"exited {done.returncode}"
            words, background = self.shell_line(text)
            if background:
                return self.start_server(words, log)
            if "$(" in text:  # a command inside another: run as written, with its stand-ins
                line = self.with_stand_ins(text)
            elif words and (words[0] in BINARIES or words[0] == "env"):
                line = shlex.join(words)
            else:  # shell syntax (&&, $(...), >, $VAR) as written
                line = text.replace(f":{PAGE_PORT}", f":{self.port}")
                if words[:1] == ["curl"]:  # an HTTP error fails the command, as a reader would see it fail
                    line = re.sub(r"(^|\s)curl(\s)", r"\1curl --fail\2", line, count=1)
            return self.run_line(line, log)


def skip_reason(kind, text):
    if kind == "sh":
        if m := re.search(r"#\s*needs:\s*(.+)$", text):
            return f"needs {m.group(1).strip()}"
        words = shlex.split(text, comments=True)
        words = [w for w in words if not re.match(r"^[A-Za-z_]\w*=", w)] if words[:1] != ["export"] else words
        if len(words) >= 2 and words[0] == "bash" and words[1] in SETUP_SCRIPTS:
            return "CI runs it (this test is part of it)"
        if test := next((t for prefix, t in RUN_BY.items() if text.startswith(prefix)), None):
            return f"CTest {test} runs it" if test != "this suite" else "it runs this suite"
        if len(words) >= 2 and words[0] == ".venv/bin/python" and words[1].startswith("bench/"):
            return "a benchmark script, minutes long: docs/BENCHMARKS.md has its result and command"
    return None


def make_reader_files(root, work):
    for here in READER_PATHS.values():
        (work / here).mkdir()
    for name, text in READER_FILES.items():
        (work / name).write_text(text)
    excerpt = (root / EXCERPT).read_text().splitlines(keepends=True)
    (work / READER_BOOK).write_text("".join(excerpt))
    for k, name in enumerate(READER_PARTS):
        path = work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        part = excerpt[k * len(excerpt) // len(READER_PARTS):(k + 1) * len(excerpt) // len(READER_PARTS)]
        if name.endswith(".jsonl"):
            path.write_text("".join(json.dumps({"text": line}) + "\n" for line in part if line.strip()))
        else:
            path.write_text("".join(part))


def fetched_by(text, root, work):
    """Stand in for the files a skipped network command would have fetched; their names."""
    made = []
    for name in FETCHED:
        if re.search(rf"(^|[\s/=]){re.escape(name)}(\s|$)", text) and not (work / name).exists():
            (work / name).write_text(play_stand_in(root))
            made.append(name)
    return made


def main():
    meshtrain, root = pathlib.Path(sys.argv[1]).resolve(), pathlib.Path(sys.argv[2]).resolve()
    pages = sys.argv[3:]
    keep_going = "--keep-going" in pages
    pages = [p for p in pages if p != "--keep-going"]
    failures, ran, skipped = [], 0, 0
    work = pathlib.Path(tempfile.mkdtemp(prefix="meshtrain-docs-"))
    try:
        (work / "build" / "bin").mkdir(parents=True)
        (work / "build" / "bin" / "meshtrain").symlink_to(meshtrain)
        if (meshtrain.parent.parent / "tests").is_dir():  # the gtest binaries a page runs
            (work / "build" / "tests").symlink_to(meshtrain.parent.parent / "tests")
        for name in ("examples", "tests", "docs", "scripts", ".venv", "README.md"):
            if (root / name).exists():
                (work / name).symlink_to(root / name)
        make_reader_files(root, work)
        for page_name in pages:
            page = Page(meshtrain, root, work)
            try:
                for number, kind, text in page_blocks(root / page_name):
                    where = f"{page_name}:{number}"
                    first_line = text.splitlines()[0] if kind == "python" else text
                    if reason := skip_reason(kind, text):
                        skipped += 1
                        print(f"skip {where}: {first_line}  ({reason})", flush=True)
                        if made := fetched_by(text, root, work):
                            print(f"     {', '.join(made)}: stood in for by {', '.join(FETCHED[m] for m in made)}", flush=True)
                        continue
                    log = work / f"log-{ran}.txt"
                    start = time.time()
                    try:
                        problem = page.run(kind, text, log)
                    except Exception as e:  # a stand-in that cannot be made, a timeout: this command failed
                        problem = f"raised {type(e).__name__}: {e}"
                    ran += 1
                    print(f"{'FAIL' if problem else 'ok  '} {where} {time.time() - start:5.1f} s: {first_line}",
                          flush=True)
                    if problem:
                        tail = log.read_text(errors="replace").splitlines()[-25:]
                        failures.append(f"{where}: `{first_line}` {problem}:\n" + "\n".join("  " + l for l in tail))
                        if not keep_going:
                            break
            finally:
                page.stop_server()
            if failures and not keep_going:
                break
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"ran {ran} commands, skipped {skipped}, {len(failures)} failed")
    if failures:
        print("\n".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
