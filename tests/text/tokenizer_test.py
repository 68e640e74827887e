"""Tokenizers against their reference libraries: token ids from meshtrain
equal the `sentencepiece` package's for a model meshtrain trained, and the
`tokenizers` / transformers GPT-2 BPE's for vocab.json + merges.txt and
tokenizer.json; decoding gives the text back. Then the whole path: training
with a tokenizer, and a Hugging Face GPT-2 with its tokenizer imported,
generating what transformers generates.

usage: tokenizer_test.py MESHTRAIN
"""
import glob
import os
import subprocess
import sys
import tempfile

import sentencepiece
import tokenizers
import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from checks import Checks  # noqa: E402

MESHTRAIN = sys.argv[1]
CHECKS = Checks(MESHTRAIN)
check, meshtrain = CHECKS.check, CHECKS.meshtrain

EXTRA = ("Naïve café — déjà vu, 東京タワー and emoji 😀👍🏽; tabs\tand  double  spaces,\n\n"
         "numbers 3.14159 and ½ ⅓, ALL CAPS, it's they'll we'd I'm you're.   \n")


def our_ids(spec, path):
    return [int(t) for t in meshtrain("tokenizer", "encode", "--tokenizer", spec, "--file", path).split()]


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first difference at {i}: {x} vs {y}"
    return f"lengths {len(a)} vs {len(b)}"


def sentencepiece_fallback(work, model_file, sp):
    """A folder whose tokenizer.json cannot be read falls back to its tokenizer.model, with
    tokenizer_config.json's BOS and special tokens written in the text as their ids."""
    folder = os.path.join(work, "sp-folder")
    os.makedirs(folder)
    with open(model_file, "rb") as src, open(os.path.join(folder, "tokenizer.model"), "wb") as dst:
        dst.write(src.read())
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write("{ truncated")
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        f.write('{"add_bos_token": true, "add_eos_token": false}')
    text = "Hello there</s> world <s>again"
    out = subprocess.run([MESHTRAIN, "tokenizer", "encode", "--tokenizer", folder, "--special", "--text", text],
                         capture_output=True, text=True)
    got = [int(t) for t in out.stdout.split()]
    want = [sp.bos_id()] + sp.encode("Hello there") + [sp.eos_id()] + sp.encode(" world ") + [sp.bos_id()] + \
        sp.encode("again")
    check(out.returncode == 0 and "reading" in out.stderr and "tokenizer.model instead" in out.stderr and got == want,
          f"a tokenizer.json that is not JSON falls back to tokenizer.model, saying so; BOS added and <s>, </s> "
          f"in the text as their ids ({got[:6]}... vs {want[:6]}...)")


def main(work):
    licenses = sorted(glob.glob("/usr/share/common-licenses/*"))
    licenses = [f for f in licenses if os.path.isfile(f)][:6]
    corpus = os.path.join(work, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        for path in licenses:
            f.write(open(path, encoding="utf-8", errors="replace").read())
        f.write(EXTRA * 3)
    text = open(corpus, encoding="utf-8").read()
    sample = os.path.join(work, "sample.txt")
    with open(sample, "w", encoding="utf-8") as f:
        f.write(text[:20000] + EXTRA)
    sample_text = open(sample, encoding="utf-8").read()

    for kind in ("unigram", "bpe"):
        prefix = os.path.join(work, f"sp-{kind}")
        meshtrain("tokenizer", "train", corpus, "--vocab", "600", "--type", kind, "--out", prefix)
        sp = sentencepiece.SentencePieceProcessor(model_file=prefix + ".model")
        want, got = sp.encode(sample_text), our_ids(prefix + ".model", sample)
        check(got == want, f"SentencePiece {kind}: {len(got)} ids equal the sentencepiece package's"
              + ("" if got == want else f" ({first_difference(got, want)})"))
        back = meshtrain("tokenizer", "decode", "--tokenizer", prefix + ".model", *map(str, got[:300]))
        check(back[:-1] == sp.decode(got[:300]), f"SentencePiece {kind}: decoding equals the package's")
    sentencepiece_fallback(work, prefix + ".model", sp)

    bpe_dir = os.path.join(work, "bpe")
    os.makedirs(bpe_dir)
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train([corpus], vocab_size=700, min_frequency=2, special_tokens=["<|endoftext|>"])
    trainer.save_model(bpe_dir)
    trainer.save(os.path.join(work, "tokenizer.json"))
    reference = transformers.GPT2TokenizerFast.from_pretrained(bpe_dir)
    want = reference.encode(sample_text)
    for spec in (bpe_dir, os.path.join(work, "tokenizer.json")):
        got = our_ids(spec, sample)
        check(got == want, f"GPT-2 BPE from {os.path.basename(spec)}: {len(got)} ids equal transformers' "
              + ("" if got == want else f"({first_difference(got, want)})"))
    check(trainer.encode(sample_text).ids == want, "(the tokenizers library agrees with transformers)")
    back = meshtrain("tokenizer", "decode", "--tokenizer", bpe_dir, *map(str, want[:400]))
    check(back[:-1] == reference.decode(want[:400]), "GPT-2 BPE: decoding gives the text back")

    # Training and generating with a tokenizer; a model too small for it is refused.
    run = os.path.join(work, "run")
    common = ["--model.preset=tiny", "--model.layers=1", "--training.steps=3", "--training.batch=2",
              "--training.micro_batch=2", f"--data.text={corpus}", f"--run.out={run}"]
    out = subprocess.run([MESHTRAIN, "train", *common, f"--data.tokenizer={bpe_dir}"], capture_output=True, text=True)
    check(out.returncode == 1 and "set model.vocab_size = 700" in out.stderr,
          "a model smaller than the tokenizer is refused: " + out.stderr.strip().splitlines()[-1])
    log = meshtrain("train", *common, f"--data.tokenizer={prefix}.model", "--model.vocab_size=600",
                    "--training.sample_tokens=12")
    check("sample after 3 steps" in log, "trains on SentencePiece tokens and samples text")
    made = meshtrain("generate", "--checkpoint", os.path.join(run, "checkpoints"), "--prompt", "The ", "--tokens", "8")
    check(made.startswith("The "), f"generate decodes with the checkpoint's tokenizer: {made.strip()!r}")

    # A Hugging Face GPT-2 with its tokenizer: imported, meshtrain generates transformers' greedy text.
    hf_dir = os.path.join(work, "hf")
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=700, n_positions=64, n_embd=48, n_layer=2,
                                                                 n_head=4)).eval()
    model.save_pretrained(hf_dir, safe_serialization=True)
    reference.save_pretrained(hf_dir)
    meshtrain("import", "hf", hf_dir, "--out", os.path.join(work, "imported"))
    prompt = "The licence says"
    ids = reference(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = reference.decode(out[0, ids.shape[1]:])
    if "<|endoftext|>" in want:
        want = want[:want.index("<|endoftext|>")]
    got = meshtrain("generate", "--checkpoint", os.path.join(work, "imported"), "--prompt", prompt, "--tokens", "12",
                    "--temperature", "0")
    check(got[:-1] == prompt + want, f"imported GPT-2 + tokenizer: greedy text equals transformers' ({want!r})")
    exported = os.path.join(work, "exported")
    meshtrain("export", "hf", os.path.join(work, "imported"), "--out", exported)
    again = transformers.AutoTokenizer.from_pretrained(exported)
    check(again.encode(sample_text) == reference.encode(sample_text), "the exported tokenizer loads in transformers")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        main(work)
    CHECKS.finish()
