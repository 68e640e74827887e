#!/usr/bin/env python3
"""Every meshtrain command the README and docs/ show that docs.run does not run still parses.

usage: check_commands.py MESHTRAIN REPO_ROOT

docs.run (run_commands.py) runs every command of README.md and docs/ but those
it skips (a GPU, hosts, Slurm or a network needed; benchmark scripts)
and those of docs/BENCHMARKS.md; this test checks what it does not run (what
docs.run runs it checks by running, at its tiny sizes; Note [Tiny sizes] keeps
a layout's degrees, batches and ranks, so a rule they break still fails there):

For each line of a ```sh block in README.md and docs/*.md that runs meshtrain
(`meshtrain`, `build/bin/meshtrain` or `./build/bin/meshtrain`, after
environment assignments; `run -n N` launches another meshtrain command):
  - the subcommand path exists and its --help exits 0;
  - every option is one the subcommand lists in its --help, or, for the
    commands that take config overrides (train and the training benches), a
    key of the training config (`train --help`), or, for `fl server` and
    `fl simulate`, a key of the federated config (`fl server --help-config`).
A `train` command is also validated for the rank count it runs on (`run -n N`,
`mpirun -np N`, `srun -n N`; else 1) as `meshtrain plan --layout config` does
before any work (every rule of the config and the layout), except on a GPU
or from a checkpoint of the reader's (checkpoint.init_from).
For each ```toml block: every [section] key of a training or federated config
exists. Prints each problem with its file and line; exits 1 if there are any.
"""
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib

BINARIES = {"meshtrain", "build/bin/meshtrain", "./build/bin/meshtrain"}
LAUNCHERS = {"mpirun": "-np", "mpiexec": "-np", "srun": "-n"}
TRAIN_OVERRIDES = {("train",), ("submit",), ("bench", "train"), ("bench", "graph"), ("bench", "tp"), ("bench", "moe"),
                   ("bench", "pp"), ("bench", "checkpoint")}
FL_OVERRIDES = {("fl", "server"), ("fl", "simulate")}
NOT_RUN = "docs/BENCHMARKS.md"  # the one page no docs.run test runs: benchmarks, minutes each


class Meshtrain:
    def __init__(self, binary):
        self.binary = binary
        self.helps = {}
        self.plans = {}

    def help(self, path):
        if path not in self.helps:
            done = subprocess.run([self.binary, *path, "--help"], capture_output=True, text=True, timeout=60)
            self.helps[path] = (done.returncode, done.stdout + done.stderr)
        return self.helps[path]

    def subcommands(self, path):
        rc, text = self.help(path)
        if rc != 0 or "Subcommands:" not in text:
            return set()
        block = text.split("Subcommands:", 1)[1]
        return {m.group(1) for m in re.finditer(r"^  (\S+)\s", block, re.M)}

    def options(self, path):
        _, text = self.help(path)
        return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w.-]*)", text.split("Subcommands:")[0]))

    def train_keys(self):
        _, text = self.help(("train",))
        return listed_keys(text.split("Keys and defaults:", 1)[1])

    def fl_keys(self):
        done = subprocess.run([self.binary, "fl", "server", "--help-config"], capture_output=True, text=True, timeout=60)
        return listed_keys(done.stdout)


def listed_keys(text):
    """section.key of every key a listing of keys names: `[section]` lines, then `  key = default  help` lines."""
    keys, section = set(), None
    for line in text.splitlines():
        if m := re.match(r"^\[([\w.]+)\]$", line.strip()):
            section = m.group(1)
        elif section and (m := re.match(r"^  (\w+) = ", line)):
            keys.add(f"{section}.{m.group(1)}")
        elif m := re.match(r"^  \[\[(\w+)\.(\w+)\]\] ([\w, ]+?)  ", line):  # an array of tables and its keys
            keys.update(f"{m.group(1)}.{m.group(2)}.{k.strip()}" for k in m.group(3).split(","))
    return keys


def sh_lines(path):
    """(line number, command) of every command in the file's ```sh blocks, continuations joined."""
    lines, fence, pending, start = [], None, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence else stripped[3:].strip()
            continue
        if fence != "sh":
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        command, pending = pending + stripped, ""
        if command and not command.startswith("#"):
            lines.append((start, command))
    return lines


def fenced_blocks(path, language):
    """(first line number, text) of each ```LANGUAGE block of the file."""
    blocks, fence, text, start = [], None, [], 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            if fence == language:
                blocks.append((start, "\n".join(text)))
            fence = None if fence else line.strip()[3:].strip()
            text, start = [], number + 1
            continue
        if fence == language:
            text.append(line)
    return blocks


def toml_blocks(path):
    return fenced_blocks(path, "toml")


def toml_value(text):
    if re.fullmatch(r"-?\d+", text) or re.fullmatch(r"-?\d*\.\d+(e-?\d+)?|-?\d+e-?\d+", text) or text in ("true", "false"):
        return text
    return '"' + text.replace('\\', '\\\\').replace('"', '\\"') + '"'


def validate_train(tool, words, ranks):
    """Problems `meshtrain train WORDS` has on `ranks` ranks, before any work: the config and layout rules."""
    sections, config = {}, None
    for word in words:
        if word.startswith("--") and "=" in word:
            key, value = word[2:].split("=", 1)
            section, name = key.split(".", 1)
            sections.setdefault(section, []).append(f"{name} = {toml_value(value)}")
        elif not word.startswith("-"):
            config = word
    if config is not None or sections.get("run") and any(l.startswith("device =") and "cpu" not in l for l in sections["run"]):
        return []  # a config file of the reader's own, or a GPU run
    if any(l.startswith("init_from =") for l in sections.get("checkpoint", [])):
        return []  # the model is the reader's checkpoint's: its options are checked, not its layout
    toml = "".join(f"[{section}]\n" + "\n".join(lines) + "\n" for section, lines in sections.items())
    if (toml, ranks) not in tool.plans:  # the same config on as many ranks is checked once
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(toml)
        try:
            done = subprocess.run([tool.binary, "plan", "--model", f.name, "--world", str(ranks), "--layout", "config"],
                                  capture_output=True, text=True, timeout=120)
        finally:
            pathlib.Path(f.name).unlink()
        tool.plans[(toml, ranks)] = (done.returncode, (done.stderr or done.stdout).strip())
    rc, text = tool.plans[(toml, ranks)]
    if rc != 0:
        return [f"`meshtrain train {' '.join(words)}` on {ranks} rank(s) is refused: {text.splitlines()[-1]}"]
    return []


def check_command(tool, words, train_keys, fl_keys, ranks=1):
    """Problems of one meshtrain command line (its words after the binary) run on `ranks` ranks."""
    path, i = (), 0
    while i < len(words) and words[i] in tool.subcommands(path):
        path += (words[i],)
        i += 1
        if path == ("run",):  # run -n N COMMAND...: the launched command is checked as one
            while i < len(words) and words[i].startswith("-"):
                if words[i] in ("-n", "--ranks") and i + 1 < len(words):
                    ranks = int(words[i + 1])
                i += 1 if "=" in words[i] else 2
            return check_command(tool, words[i:], train_keys, fl_keys, ranks)
    if not path and not all(w.split("=", 1)[0] in tool.options(()) for w in words):
        return [f"no subcommand in `meshtrain {' '.join(words)}`"]
    rc, _ = tool.help(path)
    if rc != 0:
        return [f"`meshtrain {' '.join(path)} --help` exits {rc}"]
    problems, known = [], tool.options(path)
    for word in words[i:]:
        if not word.startswith("-") or word == "-" or word.startswith("--") and len(word) == 2:
            continue
        option = word.split("=", 1)[0]
        name = option[2:]
        if option in known:
            continue
        if "." in name and path in TRAIN_OVERRIDES and name in train_keys:
            continue
        if "." in name and path in FL_OVERRIDES and name in fl_keys:
            continue
        problems.append(f"`meshtrain {' '.join(path)}` has no option {option}")
    if path == ("train",) and not problems and "--help" not in words:
        problems += validate_train(tool, words[i:], ranks)
    return problems


def check_script(root, words):
    """Problems of a `python bench/x.py ...` or `bash scripts/x.sh` line: the file exists, and a Python
    script's argument parser declares every option used (read from its source, without starting it)."""
    script = next((w for w in words if re.match(r"^(bench|scripts|tests)/[\w./-]+\.(py|sh)$", w)), None)
    if script is None:
        return []
    if not (root / script).is_file():
        return [f"{script} does not exist"]
    if not script.endswith(".py"):
        return []
    calls = re.findall(r"add_argument\(([^)]*)\)", (root / script).read_text())
    declared = {name for call in calls for name in re.findall(r"""["'](--[\w-]+)["']""", call)}
    used = [w.split("=", 1)[0] for w in words[words.index(script) + 1:] if w.startswith("--")]
    return [f"{script} has no option {o}" for o in used if o not in declared and o != "--help"]


def check_toml(text, train_keys, fl_keys):
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return [f"not TOML: {e}"]
    problems = []

    def walk(prefix, node):
        for key, value in node.items():
            name = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict):
                walk(name, value)
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                for item in value:  # [[section.name]] tables
                    walk(name, item)
            elif name.startswith("fl."):
                if name not in fl_keys:
                    problems.append(f"unknown federated key {name}")
            elif "." in name and name.split(".")[0] in {k.split(".")[0] for k in train_keys}:
                if name not in train_keys and not name.startswith("model."):
                    problems.append(f"unknown config key {name}")
                elif name.startswith("model.") and name not in train_keys:
                    problems.append(f"unknown model key {name}")
    walk("", table)
    return problems


def main():
    binary, root = sys.argv[1], pathlib.Path(sys.argv[2])
    tool = Meshtrain(binary)
    train_keys, fl_keys = tool.train_keys(), tool.fl_keys()
    assert len(train_keys) > 50 and len(fl_keys) > 20, (len(train_keys), len(fl_keys))
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    problems, commands, blocks = [], 0, 0
    from run_commands import skip_reason  # what docs.run runs, it checks by running
    for path in files:
        run_elsewhere = str(path.relative_to(root)) != NOT_RUN
        for number, line in sh_lines(path):
            if run_elsewhere and skip_reason("sh", line) is None:
                continue
            words = shlex.split(line, comments=True)
            while words and re.match(r"^\w+=", words[0]):  # VAR=value before the command
                words = words[1:]
            for problem in check_script(root, words):
                problems.append(f"{path.relative_to(root)}:{number}: {problem}")
            ranks = 1
            if words and words[0] in LAUNCHERS:  # mpirun -np N / srun -n N before the binary
                flag = LAUNCHERS[words[0]]
                ranks = int(words[words.index(flag) + 1]) if flag in words else 1
                words = words[next((k for k, w in enumerate(words) if w in BINARIES), len(words)):]
            if not words or words[0] not in BINARIES:
                continue
            commands += 1
            for problem in check_command(tool, words[1:], train_keys, fl_keys, ranks):
                problems.append(f"{path.relative_to(root)}:{number}: {problem}")
        for number, text in toml_blocks(path):
            blocks += 1
            for problem in check_toml(text, train_keys, fl_keys):
                problems.append(f"{path.relative_to(root)}:{number}: {problem}")
    # Every page with commands is one a docs.run test runs (its name on a run_commands.py line of the tests).
    tests = (root / "tests" / "CMakeLists.txt").read_text()
    for path in files:
        name = str(path.relative_to(root))
        if name != NOT_RUN and sh_lines(path) and not re.search(rf"\s{re.escape(name)}[\s)]", tests):
            problems.append(f"{name}: no docs.run test runs its commands (add it to one in tests/CMakeLists.txt)")
    for problem in problems:
        print(problem)
    print(f"checked {commands} meshtrain commands and {blocks} TOML blocks in {len(files)} files: "
          f"{len(problems)} problems")
    if commands < 20:  # BENCHMARKS.md alone holds more
        print("too few commands found: the docs' ```sh blocks were not read")
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
