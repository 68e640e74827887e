"""`meshtrain plan --auto` against the measured fastest layout: for three
models (GPT-2 style `small`, a Llama-style model, a mixture of experts) on 4
ranks, the machine is calibrated (`plan --calibrate`), `plan --auto` writes its
choice (for the MoE given the router's load from 5 steps of training with
expert parallel, `--moe-load metrics.jsonl`), and that choice and every layout of a fixed list (data parallel,
ZeRO-1/2/3, tp ± sp, pipelines, tp x pp, cp, and ep for the MoE) are trained
with `bench train` in turn, `--repeats` times; the table gives each model's
measured fastest layout and how far the choice is from it (target: within 10%).
Run from the repository root:

    .venv/bin/python bench/plan_auto_vs_measured.py [--repeats 2] [--steps 4]
"""
import argparse
import os
import re
import statistics
import sys
import tempfile
import tomllib

from plan_vs_measured import MESHTRAIN, LAYOUTS, calibrate, config_file, last_json, run

MODELS = {
    "gpt2-style small": {"model.preset": "small", "model.heads": "8"},
    "llama-style": {"model.preset": "llama-tiny", "model.width": "384", "model.layers": "6", "model.heads": "8",
                    "model.kv_heads": "4", "model.ffn_hidden": "1024"},
    "moe (4 experts, top 2)": {"model.preset": "llama-tiny", "model.width": "384", "model.layers": "4",
                               "model.heads": "8", "model.kv_heads": "4", "model.ffn_hidden": "1024",
                               "model.moe_experts": "4", "model.moe_top_k": "2", "model.moe_every": "2"},
}
MOE_LAYOUTS = {"ep=2 dp=2": {"parallel.ep": "2"}, "ep=4": {"parallel.ep": "4"}}


def chosen_keys(path):
    """Every key an --auto config sets, as train's "section.key" overrides (its micro-batch and layout included)."""
    with open(path, "rb") as f:
        config = tomllib.load(f)
    return {f"{section}.{k}": str(v).lower() if isinstance(v, bool) else str(v)
            for section, table in config.items() if isinstance(table, dict)
            for k, v in table.items() if not isinstance(v, (dict, list))}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", default="", help="comma-separated starts of names, e.g. moe (default: all)")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Names start the models' keys ("moe" for "moe (4 experts, top 2)": a key may hold a comma).
    names = [m for m in MODELS if not args.models or any(m.startswith(p.strip()) for p in args.models.split(",") if p.strip())]
    with tempfile.TemporaryDirectory() as work:
        profile = calibrate(work, env)
        summary = []
        for model in names:
            base = dict(MODELS[model], **{"model.context": str(args.context), "training.batch": str(args.batch),
                                          "training.micro_batch": str(args.micro_batch),
                                          "run.out": os.path.join(work, "run"), "training.sample_tokens": "0",
                                          "checkpoint.every": "0"})
            source = config_file(work, "source", base)
            auto = os.path.join(work, "auto.toml")
            load = []
            if "moe" in model:  # the router's load, as training reports it: a short run with expert parallel first
                out = os.path.join(work, "load-run")
                run([MESHTRAIN, "run", "-n", "4", "train", source, "--parallel.ep=2", f"--training.steps={args.steps + 1}",
                     f"--run.out={out}"], env)
                load = ["--moe-load", os.path.join(out, "metrics.jsonl")]
            run([MESHTRAIN, "plan", "--model", source, "--world", "4", "--machine", profile, "--auto", auto] + load, env)
            chosen = next(line for line in open(auto) if line.startswith("# chosen: "))[len("# chosen: "):].split(":")[0]
            layouts = dict(LAYOUTS, **(MOE_LAYOUTS if "moe" in model else {}))
            candidates = {f"{name} mb={args.micro_batch}": dict(base, **keys) for name, keys in layouts.items()}
            # The chosen micro-batch is in the layout's words ("mb=4"); the file leaves out a default one.
            keys = dict(base, **chosen_keys(auto))
            mb = re.search(r"\bmb=(\d+)", chosen)
            keys["training.micro_batch"] = mb.group(1) if mb else keys["training.micro_batch"]
            candidates[f"auto: {chosen}"] = keys
            measured = {name: [] for name in candidates}
            for _ in range(args.repeats):
                for name, keys in candidates.items():
                    try:
                        line = last_json(run([MESHTRAIN, "run", "-n", "4", "bench", "train", "--warmup-steps", "1",
                                              "--steps", str(args.steps)] + [f"--{k}={v}" for k, v in keys.items()], env))
                        measured[name].append(line["batch"] * args.context / line["tokens_per_s"])
                    except RuntimeError as error:  # a layout this model does not take (heads, experts)
                        measured[name].append(float("inf"))
                        print(f"{model}: {name}: {str(error).splitlines()[-1][:160]}", file=sys.stderr)
            medians = {name: statistics.median(v) for name, v in measured.items()}
            print(f"\n{model}, context {args.context}, batch {args.batch}, 4 ranks, median of {args.repeats}")
            for name, seconds in sorted(medians.items(), key=lambda item: item[1]):
                print(f"  {name:<44} {seconds:8.3f} s")
            fastest = min(medians, key=medians.get)
            choice = medians[f"auto: {chosen}"]
            summary.append((model, chosen, choice, fastest, medians[fastest]))
        print("\nmodel                      --auto's choice (measured s)                fastest measured (s)         choice / fastest")
        for model, chosen, choice, fastest, best in summary:
            print(f"{model:<26} {chosen:<34} {choice:7.3f}  {fastest:<28} {best:7.3f}  {choice / best:5.2f}")
        print("target: every choice within 1.10 of the fastest")


if __name__ == "__main__":
    sys.exit(main())
