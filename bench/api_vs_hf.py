"""The serving API on a Llama 3 shaped model, against Hugging Face peers in
one run:

- tokenizer: encoding 4 MB of multilingual text (few repeats), meshtrain's tokenizer.json
  reader against the `tokenizers` library (one thread each);
- scoring: prompt log-probabilities (echo, max_tokens 0) through
  `meshtrain serve`, against transformers' forward + log_softmax on the same
  batches;
- lm-eval: a multiple-choice task through local-completions, against
  lm-eval's hf backend on the exported model;
- chat: /v1/chat/completions under 1, 8 and 32 concurrent clients (tokens/s,
  p50 and p99 latency), beside /v1/completions on the same server with the
  templated conversation as its prompt (what the chat path adds).

Builds the model with tests/harness/hf_fixtures.py (random weights: speed
does not depend on them). Run from the repository root:

    .venv/bin/python bench/api_vs_hf.py [--hidden 256] [--layers 4] [--runs 3] [--parts chat]
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHTRAIN = os.path.join(ROOT, "build", "bin", "meshtrain")
sys.path.insert(0, os.path.join(ROOT, "tests", "harness"))
sys.path.insert(0, os.path.join(ROOT, "tests", "serve"))
from hf_fixtures import corpus_text, llama3_tokenizer, tiny_llama, write_corpus  # noqa: E402
import serving  # noqa: E402

# 4 MB of text without long repeats (a repeated text would be served from the BPE caches):
# the corpus's lines shuffled, and every word given a random number.
random.seed(0)
_LINES = corpus_text().split("\n")
MULTILINGUAL_TEXT = "\n".join(" ".join(f"{w}{random.randrange(100000)}" for w in random.choice(_LINES).split())
                               for _ in range(60000))[:4_000_000]


def post(url, body, path):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def tokenizer_speed(hf_dir, work):
    """MB/s of each on the same text; meshtrain's as `tokenizer encode --timing` reports it."""
    from tokenizers import Tokenizer
    text = MULTILINGUAL_TEXT
    reference = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    start = time.perf_counter()
    want = reference.encode(text, add_special_tokens=False).ids
    theirs = time.perf_counter() - start
    path = os.path.join(work, "text.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    out = subprocess.run([MESHTRAIN, "tokenizer", "encode", "--tokenizer", hf_dir, "--file", path, "--timing"],
                         check=True, capture_output=True, text=True)
    ours = float(re.search(r"\(([\d.]+) MB/s\)", out.stderr).group(1))
    same = [int(t) for t in out.stdout.split()] == want
    return ours, len(text.encode()) / 1e6 / theirs, same


def scoring_speed(url, model, tokenizer, prompts, batch):
    ids = [tokenizer(p).input_ids for p in prompts]
    tokens = sum(len(i) for i in ids)
    start = time.perf_counter()
    for k in range(0, len(ids), batch):
        post(url, {"prompt": ids[k:k + batch], "max_tokens": 0, "echo": True, "logprobs": 1}, "/v1/completions")
    ours = tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    with torch.no_grad():
        for k in range(0, len(ids), batch):
            group = ids[k:k + batch]
            longest = max(len(i) for i in group)
            padded = torch.tensor([[0] * (longest - len(i)) + i for i in group])
            mask = torch.tensor([[0] * (longest - len(i)) + [1] * len(i) for i in group])
            lp = torch.log_softmax(model(padded, attention_mask=mask).logits.float(), -1)
            lp.gather(-1, padded[:, 1:, None].clamp(min=0))
    theirs = tokens / (time.perf_counter() - start)
    return ours, theirs


def lm_eval_speed(url, exported, work, docs, batch):
    import lm_eval
    from lm_eval.tasks import TaskManager
    folder = os.path.join(work, "tasks")
    os.makedirs(folder, exist_ok=True)
    sentences = [s.strip() for s in MULTILINGUAL_TEXT.split("\n") if 20 < len(s.strip()) < 160][:docs]
    with open(os.path.join(folder, "mc.jsonl"), "w") as f:
        for k, s in enumerate(sentences):
            words = s.split()
            choices = [" ".join(words[len(words) // 2:])] + [" ".join(sentences[(k + j) % len(sentences)].split()[:6])
                                                             for j in (1, 2, 3)]
            f.write(json.dumps({"q": " ".join(words[:len(words) // 2]), "choices": choices, "answer": 0}) + "\n")
    with open(os.path.join(folder, "bench_mc.yaml"), "w") as f:
        f.write(f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder}/mc.jsonl\n"
                "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{q}}\"\ndoc_to_choice: \"{{choices}}\"\n"
                "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    tasks = TaskManager(include_path=folder)
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    models = {
        "meshtrain": LocalCompletionsAPI(model="meshtrain", base_url=f"{url}/v1/completions", tokenizer_backend="huggingface",
                                         tokenizer=exported, add_bos_token=True, num_concurrent=1, batch_size=batch),
        "hf": HFLM(pretrained=exported, dtype="float32", device="cpu", add_bos_token=True, batch_size=batch),
    }
    timed = {}
    for name in ("meshtrain", "hf", "meshtrain", "hf"):  # the first of each warms the dataset and caches up
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(model=models[name], tasks=["bench_mc"], task_manager=tasks)
        timed[name] = (time.perf_counter() - start, out["results"]["bench_mc"]["acc,none"])
    return timed, len(sentences)


def chat_load(url, clients, requests, max_tokens, tokenizer=None):
    """Chat requests, or (with the tokenizer) completions of the same conversations templated."""
    latencies, made = [], [0]
    lock = threading.Lock()

    def client(c):
        for r in range(requests):
            messages = [{"role": "user", "content": f"Tell me about licence {c}.{r}"}]
            body = {"max_tokens": max_tokens, "temperature": 0.8, "seed": 100 * c + r}
            if tokenizer:
                body["prompt"] = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                body["add_special_tokens"] = False
            else:
                body["messages"] = messages
            start = time.perf_counter()
            out = post(url, body, "/v1/completions" if tokenizer else "/v1/chat/completions")
            with lock:
                latencies.append(time.perf_counter() - start)
                made[0] += out["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    return made[0] / wall, statistics.median(latencies), latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--chat-requests", type=int, default=8, help="requests each chat client sends")
    parser.add_argument("--parts", nargs="+", default=["tokenizer", "scoring", "lm-eval", "chat"],
                        choices=["tokenizer", "scoring", "lm-eval", "chat"])
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    with tempfile.TemporaryDirectory() as work:
        corpus = write_corpus(os.path.join(work, "corpus.txt"))
        hf_dir = os.path.join(work, "hf")
        tokenizer = llama3_tokenizer(corpus, hf_dir, vocab_size=2000)
        model = tiny_llama(hf_dir, tokenizer, context=512, hidden=args.hidden, layers=args.layers)
        checkpoint, exported = os.path.join(work, "ckpt"), os.path.join(work, "exported")
        subprocess.run([MESHTRAIN, "import", "hf", hf_dir, "--out", checkpoint], check=True, capture_output=True)
        subprocess.run([MESHTRAIN, "export", "hf", checkpoint, "--out", exported], check=True, capture_output=True)
        print(f"model: Llama, hidden {args.hidden}, {args.layers} layers, vocab {len(tokenizer)}, "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; {os.cpu_count()} cores")
        for run in range(args.runs if "tokenizer" in args.parts else 0):
            ours, theirs, same = tokenizer_speed(hf_dir, work)
            print(f"[run {run + 1}] tokenizer: meshtrain {ours:.2f} MB/s, tokenizers {theirs:.2f} MB/s, "
                  f"ratio {ours / theirs:.2f}, ids equal: {same}")
        server = serving.Server(MESHTRAIN, checkpoint, "--max-batch", "32", "--queue", "256")
        try:
            prompts = [s for s in corpus_text().split("\n\n") if len(s) > 200][:64]
            prompts = [p[:600] for p in prompts]
            for run in range(args.runs if "scoring" in args.parts else 0):
                ours, theirs = scoring_speed(server.url, model, tokenizer, prompts, batch=8)
                print(f"[run {run + 1}] scoring: meshtrain {ours:.0f} tok/s, transformers {theirs:.0f} tok/s, "
                      f"ratio {ours / theirs:.2f}")
            for run in range(args.runs if "lm-eval" in args.parts else 0):
                timed, docs = lm_eval_speed(server.url, exported, work, args.docs, batch=8)
                (ours, acc), (theirs, hf_acc) = timed["meshtrain"], timed["hf"]
                print(f"[run {run + 1}] lm-eval ({docs} docs x 4 choices): local-completions {ours:.1f} s, "
                      f"hf {theirs:.1f} s, speed ratio {theirs / ours:.2f}, acc {acc:.3f} / {hf_acc:.3f}")
            for clients in (1, 8, 32) if "chat" in args.parts else ():
                for name, through in (("chat", None), ("completions", tokenizer)):
                    tps, p50, p99 = chat_load(server.url, clients, args.chat_requests, 32, through)
                    print(f"{name}: {clients} clients x {args.chat_requests} requests, {tps:.0f} tok/s, "
                          f"p50 {p50:.2f} s, p99 {p99:.2f} s", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
