"""tokenizer.json as the model families ship it, against the `tokenizers`
library: for tokenizers shaped like Llama 3, Qwen2, Llama 2 / Mistral (both
the Metaspace and the older Prepend + Replace layout), Gemma, a T5-style
Unigram and two word-level BPE layouts, each trained here on a multilingual
corpus, meshtrain's ids equal the library's on every text (with and without
the template's special tokens, special tokens written in the text
included), and decoding gives the library's text back.

usage: tokenizer_families_test.py MESHTRAIN
"""
import json
import os
import subprocess
import sys
import tempfile

import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from checks import Checks  # noqa: E402
from hf_fixtures import (MULTILINGUAL, corpus_text, llama3_tokenizer, metaspace_vocab, mistral_tokenizer,  # noqa: E402
                         qwen2_tokenizer, trained_bpe)

MESHTRAIN = sys.argv[1]
CHECKS = Checks(MESHTRAIN)
check, meshtrain = CHECKS.check, CHECKS.meshtrain

EDGE_TEXTS = ["", " ", "   leading and trailing   ", "\n\n", "a", "ﬁ", "👍🏽", "x" * 300, "  \u3000 ideographic space",
              "e\u0301\u0301", "Hello world", "ÄÖÜ äöü"]


def llama3(corpus, out):
    llama3_tokenizer(corpus, out, chat_template=False)
    return "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>  <|eot_id|>x"


def qwen2(corpus, out):
    qwen2_tokenizer(corpus, out)
    return "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nＨｉ<|im_end|>\n<|endoftext|>"


def llama2(corpus, out):
    mistral_tokenizer(corpus, out)
    return "<s>[INST] Who are you? [/INST] I am</s><s>[INST]again[/INST]"


def llama2_legacy(corpus, out, source):
    """The layout older Llama 2 / Mistral files have: Prepend + Replace normalizers, no pre-tokenizer."""
    spec = json.load(open(os.path.join(source, "tokenizer.json")))
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    spec["pre_tokenizer"] = None
    os.makedirs(out)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    return "<s>[INST] legacy layout [/INST]</s>"


def gemma(corpus, out):
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    vocab, merges = metaspace_vocab(corpus, specials)
    tok = transformers.GemmaTokenizer(vocab=vocab, merges=merges)
    tok.save_pretrained(out)
    return "<bos><start_of_turn>user\nWrite a poem<end_of_turn>\n<start_of_turn>model\n"


def unigram(corpus, out):
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=600, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False)
    tok.train([corpus], trainer)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(out)
    return "translate: Hello</s> world"


def lowercase_words(corpus, out):
    split = pre_tokenizers.Whitespace()
    vocab, merges = trained_bpe(corpus, split, 700, specials=["<unk>", "<sep>"], unk_token="<unk>",
                                end_of_word_suffix="</w>")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents(),
                                           normalizers.Strip()])
    tok.pre_tokenizer = split
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    tok.add_special_tokens([AddedToken("<sep>", lstrip=True, rstrip=True)])
    tok.add_tokens([AddedToken("ǆ", normalized=True), AddedToken("ox", single_word=True)])
    os.makedirs(out)
    tok.save(os.path.join(out, "tokenizer.json"))
    return "A box <sep>  an OX ox, ǄEMAL"


def subword_prefix(corpus, out):
    split = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
                                     pre_tokenizers.Digits(individual_digits=True)])
    vocab, merges = trained_bpe(corpus, split, 700, specials=["[UNK]"], unk_token="[UNK]",
                                continuing_subword_prefix="##")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="[UNK]", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = split
    os.makedirs(out)
    tok.save(os.path.join(out, "tokenizer.json"))
    return "numbers 2024-11-24, 😀 unknown ☃ symbols"


def ids_of(spec, paths, special):
    """meshtrain's ids for each file."""
    args = [a for p in paths for a in ("--file", p)] + (["--special"] if special else [])
    lines = meshtrain("tokenizer", "encode", "--tokenizer", spec, *args).split("\n")
    return [[int(t) for t in line.split()] for line in lines[:len(paths)]]


def decoded(spec, ids):
    """meshtrain's text for the ids, as bytes decoded (no newline translation)."""
    out = subprocess.run([MESHTRAIN, "tokenizer", "decode", "--tokenizer", spec, *map(str, ids)], capture_output=True)
    return out.stdout.decode("utf-8")[:-1] if out.returncode == 0 else f"(failed: {out.stderr!r})"


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first difference at {i}: {x} vs {y}"
    return f"lengths {len(a)} vs {len(b)}"


def check_family(name, folder, texts, work):
    reference = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    equal, compared, paths = [], 0, []
    for i, text in enumerate(texts):
        paths.append(os.path.join(work, f"{name}-{i}.txt"))
        with open(paths[-1], "w", encoding="utf-8", newline="") as f:
            f.write(text)
    for special in (False, True):
        for i, (text, got) in enumerate(zip(texts, ids_of(folder, paths, special))):
            want = reference.encode(text, add_special_tokens=special).ids
            compared += 1
            if got != want:
                equal.append(f"text {i} ({text[:30]!r}, special={special}): {first_difference(got, want)}")
    check(not equal, f"{name}: ids equal the tokenizers library's on {compared} encodings"
          + ("" if not equal else "; " + "; ".join(equal[:3])))
    ids = reference.encode(texts[0]).ids
    for cut in (len(ids), 37):
        got = decoded(folder, ids[:cut])
        want = reference.decode(ids[:cut], skip_special_tokens=False)
        check(got == want, f"{name}: decoding {cut} ids gives the library's text"
              + ("" if got == want else f" ({got[:60]!r} vs {want[:60]!r})"))


def main(work):
    corpus = os.path.join(work, "corpus.txt")
    text = corpus_text()
    with open(corpus, "w", encoding="utf-8") as f:
        f.write(text)
    sample = text[:6000] + MULTILINGUAL
    families = {}
    for name, build in (("llama3", llama3), ("qwen2", qwen2), ("llama2", llama2), ("gemma", gemma),
                        ("unigram", unigram), ("lowercase-words", lowercase_words),
                        ("subword-prefix", subword_prefix)):
        folder = os.path.join(work, name)
        families[name] = (folder, build(corpus, folder))
    folder = os.path.join(work, "llama2-legacy")
    families["llama2-legacy"] = (folder, llama2_legacy(corpus, folder, families["llama2"][0]))
    for name, (folder, special_text) in families.items():
        check_family(name, folder, [sample, special_text, *EDGE_TEXTS], work)

    # A component meshtrain does not read is named, not silently replaced.
    spec = json.load(open(os.path.join(families["llama3"][0], "tokenizer.json")))
    spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "BertNormalizer"}]}
    odd = os.path.join(work, "odd")
    os.makedirs(odd)
    with open(os.path.join(odd, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    try:
        meshtrain("tokenizer", "encode", "--tokenizer", odd, "--text", "hi")
        check(False, "an unsupported normalizer is refused")
    except RuntimeError as e:
        check("normalizer.normalizers[1] is BertNormalizer" in str(e),
              "an unsupported normalizer is refused, naming it: " + str(e).strip().splitlines()[-1])


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        main(work)
    CHECKS.finish()
