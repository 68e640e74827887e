#!/usr/bin/env python3
"""Every command a page shows runs, in the page's order, at tiny sizes.

usage: run_commands.py MESHTRAIN REPO_ROOT PAGE...

Each ```sh line and ```python block of each page runs in one scratch folder
(where `build/`, `examples/`, `tests/`, `docs/`, `scripts/` and `.venv/` lead
to the repository's), so a command finds what the commands before it made, as
a reader's would. The test scales the work down, never the command's meaning
(Note [Tiny sizes]); it runs a `serve` in the background until the next serve
or the page's end, on a free port that replaces the page's; it builds a tiny
stand-in, saved by transformers with a real tokenizer and chat template, for a
Hugging Face folder a command names as `path/to/NAME`. A command ending in a
`# needs: WHAT` comment (a GPU, hosts, Slurm, a network) is skipped with that
reason, as are the set-up scripts CI runs itself. Every other command must
exit 0 (a server must answer /health). Prints each command with its seconds;
exits 1 naming the first that failed, with its output's last lines.
"""
import os
import pathlib
import re
import shlex
import shutil
import socket
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
# training run's steps divided by 50 (at least 1; 2 where unset), so that a
# later command that resumes with more steps still trains; two transformer
# blocks unless the command sets them or starts from a checkpoint; contexts
# above 512 cut to 512; short samples; a federation's rounds cut to 2 and its
# clients' local steps to 1; selfcheck's bandwidth table up to 64 KiB (every
# collective is still checked); verify's steps to 2. Everything else (the layout, the ranks, the
# data, the model family) is the page's.
SETUP_SCRIPTS = {"scripts/main.sh", "scripts/test.sh"}
# Files a page names as the reader's own, made in the scratch folder before the pages run.
READER_FILES = {
    "my-run.toml": "[model]\npreset = \"tiny\"\n[training]\nbatch = 16\nmicro_batch = 2\n[parallel]\ntp = 2\n",
}
PAGE_PORT = "8000"


def page_blocks(path):
    """(line number, "sh" or "python", text) of each runnable item, in page order: a ```sh line (continuations
    joined) or a whole ```python block."""
    items = [(number, "sh", command) for number, command in sh_lines(path)]
    items += [(number, "python", text) for number, text in fenced_blocks(path, "python") if text.strip()]
    return sorted(items)


def free_port():
    with socket.socket() as s:
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
        command = [w for w in command if not w.startswith("--training.steps=")]
        extra.append(f"--training.steps={max(1, int(steps) // 50) if steps else 2}")
        if option(command, "--model.layers") is None and option(command, "--checkpoint.init_from") is None:
            extra.append("--model.layers=2")
        context = option(command, "--model.context")
        if context and int(context) > 512:
            command = [f"--model.context=512" if w.startswith("--model.context=") else w for w in command]
        if option(command, "--training.sample_tokens") is None:
            extra.append("--training.sample_tokens=16")
        command += extra
    elif command[:2] == ["fl", "simulate"]:
        command += ["--fl.rounds=2", "--fl.client.local_steps=1"]
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
            else:
                raise RuntimeError(f"no tiny stand-in for the Hugging Face model {name}")
            self.stand_ins[name] = out
        return self.stand_ins[name]

    def shell_line(self, line):
        """The line as it runs here: the page's port replaced, meshtrain commands scaled, stand-ins named."""
        line = line.replace(f":{PAGE_PORT}", f":{self.port}")
        words = shlex.split(line, comments=True)
        background = words[-1:] == ["&"]
        words = words[:-1] if background else words
        if words and words[0] in BINARIES:
            words = [words[0]] + scaled(words[1:])
            words = [self.stand_in(w[len("path/to/"):]) if w.startswith("path/to/") else w for w in words]
            words = [self.port if w == PAGE_PORT and words[k - 1] == "--port" else w for k, w in enumerate(words)]
            if words[1:2] == ["serve"]:
                background = True
        if words and words[0] == "curl":
            words.insert(1, "--fail")  # an HTTP error fails the command, as a reader would see it fail
        return words, background

    def stop_server(self):
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()
            self.server = None

    def start_server(self, words, log):
        self.stop_server()
        self.server = subprocess.Popen(words, cwd=self.work, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.server.poll() is not None:
                return f"the server exited with {self.server.returncode} before answering /health"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return None
            except OSError:
                time.sleep(0.2)
        return "the server did not answer /health within 120 s"

    def run(self, kind, text, log_path):
        with open(log_path, "w") as log:
            if kind == "python":
                code = text.replace(f":{PAGE_PORT}", f":{self.port}")
                done = subprocess.run([sys.executable, "-c", code], cwd=self.work, env=self.env, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=300)
                return None if done.returncode == 0 else f"exited {done.returncode}"
            words, background = self.shell_line(text)
            if background:
                return self.start_server(words, log)
            done = subprocess.run(shlex.join(words), shell=True, cwd=self.work, env=self.env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=300, executable="/bin/bash")
            return None if done.returncode == 0 else f"exited {done.returncode}"


def skip_reason(kind, text):
    if kind == "sh":
        if m := re.search(r"#\s*needs:\s*(.+)$", text):
            return f"needs {m.group(1).strip()}"
        words = shlex.split(text, comments=True)
        if len(words) >= 2 and words[0] == "bash" and words[1] in SETUP_SCRIPTS:
            return "CI runs it (this test is part of it)"
    return None


def main():
    meshtrain, root = pathlib.Path(sys.argv[1]).resolve(), pathlib.Path(sys.argv[2]).resolve()
    pages = sys.argv[3:]
    failed, ran, skipped = None, 0, 0
    work = pathlib.Path(tempfile.mkdtemp(prefix="meshtrain-docs-"))
    try:
        (work / "build" / "bin").mkdir(parents=True)
        (work / "build" / "bin" / "meshtrain").symlink_to(meshtrain)
        for name in ("examples", "tests", "docs", "scripts", ".venv"):
            if (root / name).exists():
                (work / name).symlink_to(root / name)
        for name, text in READER_FILES.items():
            (work / name).write_text(text)
        for page_name in pages:
            page = Page(meshtrain, root, work)
            try:
                for number, kind, text in page_blocks(root / page_name):
                    where = f"{page_name}:{number}"
                    first_line = text.splitlines()[0] if kind == "python" else text
                    if reason := skip_reason(kind, text):
                        skipped += 1
                        print(f"skip {where}: {first_line}  ({reason})", flush=True)
                        continue
                    log = work / f"log-{ran}.txt"
                    start = time.time()
                    problem = page.run(kind, text, log)
                    ran += 1
                    print(f"{'FAIL' if problem else 'ok  '} {where} {time.time() - start:5.1f} s: {first_line}",
                          flush=True)
                    if problem:
                        tail = log.read_text(errors="replace").splitlines()[-25:]
                        failed = f"{where}: `{first_line}` {problem}:\n" + "\n".join("  " + l for l in tail)
                        break
            finally:
                page.stop_server()
            if failed:
                break
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"ran {ran} commands, skipped {skipped}")
    if failed:
        print(failed)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
