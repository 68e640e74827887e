"""Fault soak: a training job on 4 ranks under `meshtrain run --max-restarts
--restart-on-hang`, hit again and again at random steps by a random fault:

- kill: SIGKILL of a random rank (a crash, an out-of-memory kill);
- hang: SIGSTOP of a random rank (the watchdog ends the job);
- preempt: SIGTERM to the launcher (the job saves and exits 0; this script
  then starts the same command again, as a scheduler requeues a job).

At the end the run's final parameters are compared with an uninterrupted
run's, both exported to safetensors: they must be equal to the bit. Prints a
line per fault (the step it hit, the step the job resumed from, the steps
redone, the seconds from the fault to the next step trained) and a summary
JSON line. Run from the repository root with the project's environment:

    .venv/bin/python bench/fault_soak.py [--ranks 4] [--faults 6] [--steps 60] [--seed 1]
"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import load_file

from train_vs_pytorch import MESHTRAIN

ENV = dict(os.environ, MESHTRAIN_COMM_TIMEOUT="10", MESHTRAIN_LAUNCHER_ABORT_S="10")


def train_args(steps, out):
    # A flat learning rate, so that the schedule does not depend on when a run started.
    return ["train", "--model.preset=tiny", "--model.layers=2", "--training.batch=8", "--training.micro_batch=2",
            f"--training.steps={steps}", "--training.lr=1e-3", "--training.min_lr=1e-3", "--training.warmup=0",
            "--training.eval_every=0", "--training.sample_tokens=0", "--checkpoint.every=5", f"--run.out={out}"]


def rows(out):
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def last_step(out):
    steps = [r["step"] for r in rows(out) if "loss" in r]
    return steps[-1] if steps else 0


def trained_after_last_resume(out, resumed):
    written = rows(out)
    last = max(i for i, r in enumerate(written) if r.get("event") == "resumed")
    return any("loss" in r and r["step"] == resumed + 1 for r in written[last:])


def rank_pids(out):
    """The train processes of the run: argv is `meshtrain train ... --run.out=OUT` (not the launcher, not mpirun)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if len(argv) > 2 and argv[0] == os.path.realpath(MESHTRAIN).encode() and argv[1] == b"train" and \
                f"--run.out={out}".encode() in argv:
            pids.append(int(pid))
    return pids


def wait_until(condition, what, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def export(out, folder):
    subprocess.run([MESHTRAIN, "export", "hf", os.path.join(out, "checkpoints"), "--out", folder], check=True,
                   stdout=subprocess.DEVNULL)
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def launch(command, log):
    return subprocess.Popen(command, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def soak(args, work):
    out = os.path.join(work, "soak")
    restarts = args.faults  # at most one per fault; preemptions use none
    command = [MESHTRAIN, "run", "-n", str(args.ranks), "--max-restarts", str(restarts), "--restart-on-hang"] + \
        train_args(args.steps, out)
    chooser = random.Random(args.seed)
    log = open(os.path.join(work, "soak.log"), "w")
    launcher = launch(command, log)
    faults = []
    for _ in range(args.faults):
        target = max(last_step(out) + chooser.randint(2, 6), 7)  # past the first checkpoint (step 5)
        if target >= args.steps - 2:
            break
        wait_until(lambda: last_step(out) >= target, f"step {target}")
        kind = chooser.choice(["kill", "hang", "preempt"])
        resumes = sum(r.get("event") == "resumed" for r in rows(out))
        hit = last_step(out)
        start = time.time()
        if kind == "preempt":
            launcher.send_signal(signal.SIGTERM)
            if launcher.wait(timeout=120) != 0:
                raise RuntimeError(f"a preempted run exited {launcher.returncode}: see {log.name}")
            hit = [r for r in rows(out) if r.get("event") == "preempted"][-1]["step"]  # it finished that step
            launcher = launch(command, log)
        else:
            pids = rank_pids(out)
            os.kill(chooser.choice(pids), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        # Recovered: a new "resumed" line, then a step trained after it.
        wait_until(lambda: sum(r.get("event") == "resumed" for r in rows(out)) > resumes, f"a resume after {kind}")
        resumed = [r for r in rows(out) if r.get("event") == "resumed"][-1]["step"]
        wait_until(lambda: trained_after_last_resume(out, resumed), f"a step after the resume at {resumed}")
        faults.append({"fault": kind, "hit_step": hit, "resumed_step": resumed, "steps_redone": hit - resumed,
                       "recover_seconds": round(time.time() - start, 2)})
        print(f"{kind:8s} at step {hit:3d}: resumed from step {resumed:3d} ({hit - resumed} redone), "
              f"training again after {faults[-1]['recover_seconds']:.1f} s", flush=True)
    if launcher.wait(timeout=600) != 0:
        raise RuntimeError(f"the soaked run exited {launcher.returncode}: see {log.name}")
    return out, faults


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshtrain-soak-") as work:
        reference = os.path.join(work, "reference")
        subprocess.run([MESHTRAIN, "run", "-n", str(args.ranks)] + train_args(args.steps, reference), env=ENV,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        out, faults = soak(args, work)
        expected, got = export(reference, os.path.join(work, "reference-hf")), export(out, os.path.join(work, "soak-hf"))
        differ = [name for name in expected if not np.array_equal(expected[name], got.get(name))]
        summary = {"ranks": args.ranks, "steps": args.steps, "faults": len(faults),
                   "by_kind": {k: sum(f["fault"] == k for f in faults) for k in ("kill", "hang", "preempt")},
                   "median_steps_redone": statistics.median(f["steps_redone"] for f in faults) if faults else 0,
                   "median_recover_seconds": statistics.median(f["recover_seconds"] for f in faults) if faults else 0,
                   "max_recover_seconds": max((f["recover_seconds"] for f in faults), default=0),
                   "parameters_equal": not differ and set(expected) == set(got), "tensors": len(expected)}
        print(json.dumps(summary))
        if differ:
            print(f"fault_soak: {len(differ)} tensors differ from the uninterrupted run's, e.g. {differ[0]}",
                  file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
