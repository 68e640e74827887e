"""meshtrain prepare against Hugging Face `tokenizers` (Rust, batch encoding)
on the same documents, tokenizer and cores: tokens per second per core, and
meshtrain's peak memory against the corpus size.

The corpus is tiny Shakespeare cut into paragraphs, repeated to --mb MiB of
JSON Lines; the tokenizer a byte-level BPE of --vocab tokens trained on it
(the kind GPT-2, Llama 3 and Qwen use). tokenizers encodes the same
paragraphs with encode_batch, RAYON_NUM_THREADS cores; meshtrain prepare runs
on that many ranks (`meshtrain run -n N prepare`), its tokenizing time as it
reports it (reading JSON, tokenizing and writing the parts; not the join).

usage: prepare_vs_tokenizers.py MESHTRAIN [--mb 64] [--vocab 8000] [--cores 1 2] [--repeats 3]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "..", "shared", "data", "tinyshakespeare.txt")


def tokenizers_rate(tokenizer_path, documents, cores):
    """tokens/s of encode_batch in a fresh process with `cores` Rayon threads."""
    code = f"""
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file({tokenizer_path!r})
docs = [json.loads(l)["text"] for l in open({documents!r})]
start = time.perf_counter()
n = sum(len(e.ids) for e in tok.encode_batch(docs))
print(n, time.perf_counter() - start)
"""
    env = dict(os.environ, RAYON_NUM_THREADS=str(cores), TOKENIZERS_PARALLELISM="true")
    out = subprocess.run([os.path.join(HERE, "..", ".venv", "bin", "python"), "-c", code], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]) / float(out[1])


def meshtrain_rate(meshtrain, folder, documents, cores, work):
    out = os.path.join(work, f"prep-{cores}-{time.time()}")
    prefix = [meshtrain] if cores == 1 else [meshtrain, "run", "-n", str(cores)]
    r = subprocess.run(prefix + ["prepare", documents, "--out", out, "--tokenizer", folder, "--split-mb", "4"],
                       capture_output=True, text=True, check=True).stdout
    m = re.search(r"tokenizing ([\d.]+) s: (\d+) tokens/s", r)
    peak = re.search(r"peak memory (\d+) MiB", r)
    subprocess.run(["rm", "-rf", out], check=True)
    return float(m.group(2)), int(peak.group(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("meshtrain")
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--cores", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    a = parser.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    text = open(CORPUS, encoding="utf-8").read()
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-prepare-") as work:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator([text], trainers.BpeTrainer(
            vocab_size=a.vocab, show_progress=False, special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        folder = os.path.join(work, "tokenizer")
        os.makedirs(folder)
        tok.save(os.path.join(folder, "tokenizer.json"))
        documents = os.path.join(work, "docs.jsonl")
        size = 0
        with open(documents, "w") as f:
            while size < a.mb << 20:
                for p in paragraphs:
                    line = json.dumps({"text": p}) + "\n"
                    f.write(line)
                    size += len(line)
        print(f"corpus: {size / 2**20:.1f} MiB of JSON Lines, {len(paragraphs)} paragraphs repeated; "
              f"byte-level BPE of {tok.get_vocab_size()} tokens")
        for cores in a.cores:
            ours = [meshtrain_rate(a.meshtrain, folder, documents, cores, work) for _ in range(a.repeats)]
            theirs = [tokenizers_rate(os.path.join(folder, "tokenizer.json"), documents, cores)
                      for _ in range(a.repeats)]
            mine = statistics.median(r for r, _ in ours)
            peer = statistics.median(theirs)
            print(f"{cores} core(s): meshtrain prepare {mine / cores:,.0f} tokens/s per core, tokenizers encode_batch "
                  f"{peer / cores:,.0f} tokens/s per core: {mine / peer:.2f}x (medians of {a.repeats}); "
                  f"meshtrain peak memory {max(p for _, p in ours)} MiB per rank")


if __name__ == "__main__":
    main()
