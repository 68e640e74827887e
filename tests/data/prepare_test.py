"""meshtrain prepare against the libraries people prepare data with: JSON
Lines (plain, gzip, zstd), Parquet (pyarrow) and text files tokenized by
meshtrain equal Hugging Face `tokenizers` on the same documents, end-of-text
between them; ids past 65,535 are kept (4 bytes per token); 1, 2 and 3 ranks
write byte-identical files; a killed run resumes with the units it had
finished; peak memory does not grow with the corpus; chat records equal
transformers' apply_chat_template with the assistant's tokens, and only those,
counted; bad input is refused once, naming the file and line.

usage: prepare_test.py MESHTRAIN
"""
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
from checks import Checks  # noqa: E402

MESHTRAIN = sys.argv[1]
CHECKS = Checks(MESHTRAIN)
check = CHECKS.check
EXCERPT = open(os.path.join(HERE, "shakespeare_excerpt.txt"), encoding="utf-8").read()
DOCUMENTS = [p.strip() for p in EXCERPT.split("\n\n") if p.strip()]
LLAMA3 = open(os.path.join(HERE, "..", "text", "chat_templates", "llama3.jinja"), encoding="utf-8").read()


def tokens(path):
    """A token file's ids (header: magic, version, bytes per token, count, vocabulary)."""
    raw = open(path, "rb").read()
    assert raw[:8] == b"MTTOKENS", path
    width, count = int.from_bytes(raw[12:16], "little"), int.from_bytes(raw[16:24], "little")
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    return width, np.frombuffer(raw[32:], dtype=dtype, count=count).astype(np.int64)


def prepare(*args, ranks=1):
    prefix = [MESHTRAIN] if ranks == 1 else [MESHTRAIN, "run", "-n", str(ranks)]
    return subprocess.run(prefix + ["prepare", *args], capture_output=True, text=True)


def tokenizer_folder(work, extra_tokens=0):
    """A byte-level BPE with <|endoftext|>, the Llama 3 chat tokens and template, and
    `extra_tokens` added tokens (to push ids past 65,535)."""
    folder = os.path.join(work, f"tokenizer-{extra_tokens}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([EXCERPT, LLAMA3], trainers.BpeTrainer(
        vocab_size=500, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    specials = ["<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if extra_tokens:
        tok.add_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
    tok.save(os.path.join(work, "tok.json"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(work, "tok.json"),
                                                bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    fast.chat_template = LLAMA3
    fast.save_pretrained(folder)
    return folder, tok, fast


def expected_stream(tok, documents):
    eot = tok.token_to_id("<|endoftext|>")
    out = []
    for encoding in tok.encode_batch(documents):
        out += encoding.ids + [eot]
    return np.array(out, dtype=np.int64)


def check_formats(work, folder, tok):
    """Each format's tokens equal tokenizers' on the same documents."""
    records = [{"id": i, "text": d} for i, d in enumerate(DOCUMENTS)]
    jsonl = "".join(json.dumps(r) + "\n" for r in records)
    src = os.path.join(work, "src")
    os.makedirs(src, exist_ok=True)
    open(os.path.join(src, "plain.jsonl"), "w").write(jsonl)
    with gzip.open(os.path.join(src, "docs.jsonl.gz"), "wt") as f:
        f.write(jsonl)
    shutil.copy(os.path.join(src, "plain.jsonl"), os.path.join(src, "z.jsonl"))
    subprocess.run(["zstd", "-q", "-f", "--rm", os.path.join(src, "z.jsonl")], check=True)
    shutil.copy(os.path.join(src, "plain.jsonl"), os.path.join(src, "nocheck.jsonl"))
    subprocess.run(["zstd", "-q", "-f", "--rm", "--no-check", os.path.join(src, "nocheck.jsonl")], check=True)
    # A struct column before the text one: columns are found by name, not position.
    meta = pa.array([{"a": i, "b": str(i)} for i in range(len(records))])
    pq.write_table(pa.table({"meta": meta, "id": [r["id"] for r in records], "text": [r["text"] for r in records]}),
                   os.path.join(src, "docs.parquet"), row_group_size=7)
    want = expected_stream(tok, DOCUMENTS)
    for name in ["plain.jsonl", "docs.jsonl.gz", "z.jsonl.zst", "nocheck.jsonl.zst", "docs.parquet"]:
        out = os.path.join(work, "fmt-" + name)
        r = prepare(os.path.join(src, name), "--out", out, "--tokenizer", folder, "--split-mb", "1")
        if r.returncode != 0:
            check(False, f"{name}: prepare failed: {r.stderr}")
            continue
        got = np.concatenate([tokens(os.path.join(out, "train.bin"))[1], tokens(os.path.join(out, "val.bin"))[1]])
        check(np.array_equal(got, want), f"{name}: {len(got)} tokens equal tokenizers' encode_batch of "
                                         f"{len(DOCUMENTS)} documents with <|endoftext|> after each")
        index = np.concatenate([tokens(os.path.join(out, "train.idx"))[1][:-1],
                                tokens(os.path.join(out, "val.idx"))[1][:-1] + tokens(os.path.join(out, "train.idx"))[1][-1]])
        lengths = [len(e.ids) + 1 for e in tok.encode_batch(DOCUMENTS)]
        check(list(index) == list(np.cumsum([0] + lengths[:-1])), f"{name}: the document index holds every start")
    # A folder of shards with a README: the data files only, in order.
    open(os.path.join(src, "README.md"), "w").write("# not data\n")
    r = prepare(src, "--out", os.path.join(work, "folder"), "--tokenizer", folder)
    check(r.returncode == 0 and "5 file(s)" in r.stdout, f"a folder reads its 5 data files, not its README: {r.stdout}")


def check_large_vocabulary(work):
    folder, tok, _ = tokenizer_folder(work, extra_tokens=66000)
    docs = [d + f" <extra_{65990 + i % 10}>" for i, d in enumerate(DOCUMENTS)]
    path = os.path.join(work, "big.jsonl")
    open(path, "w").write("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = os.path.join(work, "big")
    r = prepare(path, "--out", out, "--tokenizer", folder)
    if r.returncode != 0:
        return check(False, f"a {tok.get_vocab_size()}-token vocabulary prepares: {r.stderr}")
    width, train = tokens(os.path.join(out, "train.bin"))
    got = np.concatenate([train, tokens(os.path.join(out, "val.bin"))[1]])
    check(width == 4 and got.max() > 65535, f"ids past 65,535 take 4 bytes (largest id {got.max()})")
    check(np.array_equal(got, expected_stream(tok, docs)), "and equal tokenizers'")


def check_ranks_and_resume(work, folder):
    """1, 2, 3 ranks: identical bytes; a killed run resumes."""
    corpus = os.path.join(work, "many.jsonl")
    with open(corpus, "w") as f:
        for i in range(12000):
            f.write(json.dumps({"text": DOCUMENTS[i % len(DOCUMENTS)] + f" ({i})"}) + "\n")
    outputs = {}
    for ranks in (1, 2, 3):
        out = os.path.join(work, f"ranks-{ranks}")
        r = prepare(corpus, "--out", out, "--tokenizer", folder, "--split-mb", "1", ranks=ranks)
        if r.returncode != 0:
            return check(False, f"{ranks} ranks: {r.stderr}")
        outputs[ranks] = {n: open(os.path.join(out, n), "rb").read()
                          for n in ["train.bin", "val.bin", "train.idx", "val.idx"]}
        print(r.stdout.strip().splitlines()[-1], flush=True)
    check(outputs[1] == outputs[2] == outputs[3], "1, 2 and 3 ranks write byte-identical token and index files")
    # Killed after some units, then run again: only the rest is tokenized, and the output is the same.
    out = os.path.join(work, "resumed")
    p = subprocess.Popen([MESHTRAIN, "prepare", corpus, "--out", out, "--tokenizer", folder, "--split-mb", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parts = os.path.join(out, "parts")
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        done = [n for n in os.listdir(parts) if n.endswith(".json")] if os.path.isdir(parts) else []
        if len(done) >= 1:
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    p.wait()
    r = prepare(corpus, "--out", out, "--tokenizer", folder, "--split-mb", "1")
    m = re.search(r"(\d+) finished before", r.stdout)
    check(r.returncode == 0 and m is not None and int(m.group(1)) >= 1,
          f"a killed prepare resumes with its finished units: {r.stdout.strip()}")
    check(all(open(os.path.join(out, n), "rb").read() == outputs[1][n] for n in outputs[1]),
          "and writes the same bytes as one uninterrupted run")
    r = prepare(corpus, "--out", out, "--tokenizer", folder, "--split-mb", "1")
    check("nothing to do" in r.stdout, "prepared again with the same plan: nothing to do")


def check_memory(work):
    """Peak memory (RSS) of a corpus 12x larger grows by far less than the corpus (allocator noise is ~20 MiB)."""
    peaks = {}
    for mb in (8, 96):
        corpus = os.path.join(work, f"rss-{mb}.jsonl")
        with open(corpus, "w") as f:
            line = json.dumps({"text": EXCERPT[:2000]}) + "\n"
            f.write(line * (mb * (1 << 20) // len(line)))
        r = prepare(corpus, "--out", os.path.join(work, f"rss-{mb}"), "--split-mb", "2")
        m = re.search(r"peak memory (\d+) MiB", r.stdout)
        if r.returncode != 0 or not m:
            return check(False, f"{mb} MiB corpus: {r.stdout} {r.stderr}")
        peaks[mb] = int(m.group(1))
        os.remove(corpus)
        shutil.rmtree(os.path.join(work, f"rss-{mb}"))
    check(peaks[96] - peaks[8] < 40, f"peak memory {peaks[8]} MiB for 8 MiB of text, {peaks[96]} MiB for 96 MiB "
                                     "(2 MiB units, 1 byte per token): bounded by the unit, not the corpus")


def check_chat(work, folder, fast):
    """Chat records: the ids of apply_chat_template, the assistant's tokens counted."""
    conversations = [
        [{"role": "user", "content": "Who wrote this?"}, {"role": "assistant", "content": "A playwright."}],
        [{"role": "system", "content": "Answer in verse."}, {"role": "user", "content": "Speak."},
         {"role": "assistant", "content": "Friends, Romans!"}, {"role": "user", "content": "More."},
         {"role": "assistant", "content": "Lend me your ears."}],
    ] * 20
    path = os.path.join(work, "chat.jsonl")
    with open(path, "w") as f:
        for c in conversations:
            f.write(json.dumps({"messages": c}) + "\n")
        f.write(json.dumps({"prompt": "Say hi.", "completion": "Hi."}) + "\n")
    # The same records as Parquet: a list<struct<role, content>> column and two string columns.
    parquet = os.path.join(work, "chat.parquet")
    pq.write_table(pa.table({"messages": conversations + [None], "prompt": [None] * len(conversations) + ["Say hi."],
                             "completion": [None] * len(conversations) + ["Hi."]}), parquet, row_group_size=9)
    out = os.path.join(work, "chat")
    r = prepare(path, "--out", out, "--tokenizer", folder, "--format", "chat", "--val-fraction", "0.05")
    if r.returncode != 0:
        return check(False, f"chat prepare: {r.stderr}")
    ids = np.concatenate([tokens(os.path.join(out, n + ".bin"))[1] for n in ("train", "val")])
    mask = np.concatenate([tokens(os.path.join(out, n + ".mask"))[1] for n in ("train", "val")])
    r = prepare(parquet, "--out", os.path.join(work, "chat-parquet"), "--tokenizer", folder, "--format", "chat",
                "--val-fraction", "0.05")
    same = r.returncode == 0 and all(open(os.path.join(out, n), "rb").read() ==
                                     open(os.path.join(work, "chat-parquet", n), "rb").read()
                                     for n in ("train.bin", "train.mask", "val.bin", "val.mask"))
    check(same, "the same conversations from Parquet give the same tokens and mask" + ("" if same else r.stderr))
    records = conversations + [[{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]]
    want = []
    for c in records:
        want += fast.apply_chat_template(c, tokenize=True, return_dict=False)
    check(list(ids) == want, f"{len(records)} conversations: the ids of transformers' apply_chat_template")
    # By hand: after each "<|start_header_id|>assistant<|end_header_id|>\n\n" up to and with its <|eot_id|>.
    header = fast.encode("<|start_header_id|>assistant<|end_header_id|>\n\n", add_special_tokens=False)
    eot = fast.convert_tokens_to_ids("<|eot_id|>")
    hand = np.zeros(len(want), dtype=np.int64)
    i = 0
    while i < len(want):
        if want[i:i + len(header)] == header:
            j = i + len(header)
            while want[j] != eot:
                hand[j] = 1
                j += 1
            hand[j] = 1
            i = j
        i += 1
    check(np.array_equal(mask, hand), f"the mask counts the assistant replies and their <|eot_id|> only "
                                      f"({int(hand.sum())} of {len(hand)} tokens)")
    r = prepare(path, "--out", os.path.join(work, "chat-all"), "--tokenizer", folder, "--format", "chat",
                "--loss-on", "all")
    all_mask = np.concatenate([tokens(os.path.join(work, "chat-all", n + ".mask"))[1] for n in ("train", "val")])
    check(r.returncode == 0 and all_mask.all(), "--loss-on all counts every token")


def check_hostile(work, folder):
    cases = {
        "bad.jsonl": ('{"text": "fine"}\n{"text": "cut', "bad.jsonl line 2: not a JSON value"),
        "field.jsonl": ('{"body": "x"}\n', 'field.jsonl line 1: no string field "text" (the record has: body)'),
        "broken.jsonl.gz": ("not gzip at all", "broken.jsonl.gz: is not valid gzip"),
        "broken.parquet": ("PAR1 not really", "broken.parquet: is not a Parquet file"),
    }
    for name, (content, message) in cases.items():
        path = os.path.join(work, name)
        open(path, "w").write(content)
        r = prepare(path, "--out", os.path.join(work, "hostile"), "--tokenizer", folder)
        check(r.returncode != 0 and r.stderr.count(message) == 1, f"{name}: refused once with \"{message}\"")
        check(not os.path.exists(os.path.join(work, "hostile")), f"{name}: no parts/ nor an empty folder left behind")
    pq.write_table(pa.table({"body": ["x"]}), os.path.join(work, "nocolumn.parquet"))
    r = prepare(os.path.join(work, "nocolumn.parquet"), "--out", os.path.join(work, "hostile"), "--tokenizer", folder)
    check(r.returncode != 0 and "nocolumn.parquet: has no column text (its columns: body)" in r.stderr,
          "a Parquet file without the text column is refused, naming its columns")
    with open(os.path.join(work, "oneline.txt"), "w") as f:
        f.write("x" * (70 << 20))
    r = prepare(os.path.join(work, "oneline.txt"), "--out", os.path.join(work, "hostile"), "--split-mb", "1")
    check(r.returncode != 0 and "oneline.txt: the line at byte 0 is longer than 64 MiB" in r.stderr,
          "a 70 MiB line is refused rather than held in memory")
    os.remove(os.path.join(work, "oneline.txt"))
    messages = os.path.join(work, "noassistant.jsonl")
    open(messages, "w").write(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    r = prepare(messages, "--out", os.path.join(work, "hostile"), "--tokenizer", folder, "--format", "chat")
    check(r.returncode != 0 and "noassistant.jsonl line 1: the conversation has no assistant message" in r.stderr,
          "a conversation without an assistant turn is refused by line")
    r = prepare(os.path.join(work, "src", "plain.jsonl"), "--out", os.path.join(work, "after"), "--tokenizer", folder)
    check(r.returncode == 0, "and good data still prepares after")
    # Without --out: under runs/ of the working folder (which .gitignore has), not a data/ beside the sources;
    # train's key names work as prepare's options.
    r = subprocess.run([MESHTRAIN, "prepare", os.path.join(work, "src", "plain.jsonl"), "--data.tokenizer=" + folder,
                        "--data.val_fraction", "0.2"],
                       capture_output=True, text=True, cwd=work)
    check(r.returncode == 0 and os.path.exists(os.path.join(work, "runs", "data", "train.bin"))
          and not os.path.exists(os.path.join(work, "data")), f"prepare writes runs/data by default ({r.stderr[-200:]})")


def check_mixture_training(work):
    """[[data.sources]] with weights: each source prepared apart, training reads both."""
    a, b = os.path.join(work, "mix-a.jsonl"), os.path.join(work, "mix-b.txt")
    open(a, "w").write("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS))
    open(b, "w").write(EXCERPT)
    config = os.path.join(work, "mix.toml")
    open(config, "w").write(f"""[model]
preset = "tiny"
context = 32

[training]
steps = 2
batch = 4
micro_batch = 2
sample_tokens = 0

[[data.sources]]
path = "{a}"
weight = 3

[[data.sources]]
path = ["{b}"]
weight = 1

[run]
out = "{os.path.join(work, 'mix-run')}"
""")
    r = subprocess.run([MESHTRAIN, "train", config], capture_output=True, text=True)
    prepared = [os.path.exists(os.path.join(work, "mix-run", "data", f"source-{i}", "train.bin")) for i in (0, 1)]
    check(r.returncode == 0 and all(prepared) and "and 1 more" in r.stdout,
          "a mixture of two [[data.sources]] is prepared source by source and trained on" +
          ("" if r.returncode == 0 else ": " + r.stderr[-300:]))


def main():
    with tempfile.TemporaryDirectory(prefix="meshtrain-prepare-") as work:
        folder, tok, fast = tokenizer_folder(work)
        check_formats(work, folder, tok)
        check_large_vocabulary(work)
        check_ranks_and_resume(work, folder)
        check_memory(work)
        check_chat(work, folder, fast)
        check_hostile(work, folder)
        check_mixture_training(work)
    CHECKS.finish()


if __name__ == "__main__":
    main()
