"""The planner's step time against the measured one, for every layout 4 ranks
allow of one model: the machine is calibrated first (`plan --calibrate`: each
operator class's rate, a training run's overhead beyond them, the
collectives' latency and bandwidth),
then each layout is planned (`plan --layout config --machine PROFILE`) and
trained (`bench train`, the median of its timed steps), `--repeats` times in
turn; the table gives the medians, their ratio, and the Spearman correlation
of the predicted and measured rankings. Run from the repository root:

    .venv/bin/python bench/plan_vs_measured.py [--preset small] [--repeats 3] [--steps 4]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")

# Every layout of 4 ranks the dense model allows, as train's keys.
LAYOUTS = {
    "dp=4": {},
    "zero=1 fsdp=4": {"parallel.zero_stage": "1"},
    "zero=2 fsdp=4": {"parallel.zero_stage": "2"},
    "zero=3 fsdp=4": {"parallel.zero_stage": "3"},
    "tp=2 dp=2": {"parallel.tp": "2"},
    "tp=2 sp dp=2": {"parallel.tp": "2", "parallel.sequence_parallel": "true"},
    "tp=4 sp": {"parallel.tp": "4", "parallel.sequence_parallel": "true"},
    "pp=2 1f1b dp=2": {"parallel.pp": "2", "parallel.pp_schedule": "1f1b"},
    "pp=2 gpipe dp=2": {"parallel.pp": "2", "parallel.pp_schedule": "gpipe"},
    "pp=4 1f1b": {"parallel.pp": "4", "parallel.pp_schedule": "1f1b"},
    "cp=2 dp=2": {"parallel.cp": "2"},
    "cp=4": {"parallel.cp": "4"},
    "tp=2 pp=2": {"parallel.tp": "2", "parallel.pp": "2"},
    "tp=2 zero=3 fsdp=2": {"parallel.tp": "2", "parallel.zero_stage": "3"},
}


def run(command, env=None):
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out.stdout


def last_json(text):
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no JSON line in:\n" + text)


def toml_value(value):
    return value if value in ("true", "false") or value.replace(".", "").isdigit() else f'"{value}"'


def config_file(work, name, keys):
    """A train config of `keys` ("section.key" -> value)."""
    sections = {}
    for dotted, value in keys.items():
        section, key = dotted.split(".", 1)
        sections.setdefault(section, []).append(f"{key} = {toml_value(value)}")
    path = os.path.join(work, name.replace(" ", "_").replace("=", "") + ".toml")
    with open(path, "w") as f:
        for section, lines in sections.items():
            f.write(f"[{section}]\n" + "\n".join(lines) + "\n")
    return path


def picked(text, known):
    """The comma-separated names of `text`, or every name `known` has."""
    return [n.strip() for n in text.split(",") if n.strip()] or list(known)


def calibrate(work, env):
    """This machine's profile from `plan --calibrate` on 4 ranks: its path."""
    profile = os.path.join(work, "machine.json")
    run([MESHTRAIN, "run", "-n", "4", "plan", "--calibrate", "--save", profile], env)
    return profile


def spearman(xs, ys):
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        r = [0.0] * len(values)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="with 8 heads, so that tp=4 divides them")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (bench train reports their median)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    names = picked(args.layouts, LAYOUTS)
    with tempfile.TemporaryDirectory() as work:
        profile = calibrate(work, env)
        machine = json.load(open(profile))
        print(f"machine calibrated: {machine['peak_flops'] / 1e9:.1f} GFLOP/s per rank, MFU {machine['mfu']:.3f}, "
              f"{machine['intra_bandwidth'] / 1e9:.2f} GB/s, latency {machine['latency'] * 1e6:.1f} us")
        ops = machine.get("operators")
        if ops:
            print(f"operators: products {ops['matmul_flops'] / 1e9:.1f} GFLOP/s + {ops['matmul_call'] * 1e6:.1f} us, "
                  f"attention {ops['attention_flops'] / 1e9:.1f} GFLOP/s + {ops['attention_call'] * 1e6:.1f} us, "
                  f"elementwise {ops['elementwise_bytes'] / 1e9:.1f} GB/s + {ops['elementwise_call'] * 1e6:.2f} us, "
                  f"overhead {ops['overhead']:.3f}")
        base = {"model.preset": args.preset, "model.heads": "8", "model.context": str(args.context),
                "training.batch": str(args.batch),
                "training.micro_batch": str(args.micro_batch), "run.out": os.path.join(work, "run"),
                "training.sample_tokens": "0", "checkpoint.every": "0"}
        predicted, measured = {}, {n: [] for n in names}
        for name in names:
            keys = dict(base, **LAYOUTS[name])
            plan = json.loads(run([MESHTRAIN, "plan", "--model", config_file(work, name, keys), "--world", "4",
                                   "--layout", "config", "--machine", profile, "--json"], env))
            predicted[name] = plan["time_seconds"]["step"]
        for r in range(args.repeats):
            for name in names:
                keys = dict(base, **LAYOUTS[name])
                line = last_json(run([MESHTRAIN, "run", "-n", "4", "bench", "train", "--warmup-steps", "1", "--steps",
                                      str(args.steps)] + [f"--{k}={v}" for k, v in keys.items()], env))
                measured[name].append(line["batch"] * args.context / line["tokens_per_s"])
        print(f"{args.preset}, context {args.context}, batch {args.batch}, micro-batch {args.micro_batch}, 4 ranks, "
              f"median of {args.repeats}")
        print(f"{'layout':<22} {'predicted s':>11} {'measured s':>11} {'measured/predicted':>19}")
        rows = []
        for name in names:
            m = statistics.median(measured[name])
            rows.append((name, predicted[name], m))
            print(f"{name:<22} {predicted[name]:11.3f} {m:11.3f} {m / predicted[name]:19.2f}")
        within = sum(1 for _, p, m in rows if abs(m / p - 1) <= 0.25)
        rho = spearman([p for _, p, _ in rows], [m for _, _, m in rows])
        print(f"within 25%: {within} of {len(rows)}; Spearman of the rankings: {rho:.2f} (targets: all, >= 0.8)")


if __name__ == "__main__":
    sys.exit(main())
