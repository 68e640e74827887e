"""Hugging Face model folders the tests build offline: a corpus; tokenizers
shaped like Llama 3's (byte-level BPE, its pre-tokenizer pattern, its
special tokens, its template and chat template), Mistral's (Metaspace BPE
with byte fallback, [INST] turns) and Qwen2's (byte-level BPE, ChatML); and
tiny random Llama, Mistral and Qwen2 models with them, saved as transformers
saves them."""
import glob
import json
import os

import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
CHAT_TEMPLATES = os.path.join(HERE, "..", "text", "chat_templates")
MULTILINGUAL = (
    "Naïve café — déjà vu, Straße, İstanbul, ǅemal. 東京タワーは高い。北京欢迎你！ 서울 특별시. "
    "Москва — столица. Ελληνικά κείμενα. مرحبا بالعالم. नमस्ते दुनिया. ไทย ภาษา.\n"
    "emoji 😀👍🏽👨‍👩‍👧 flags 🇫🇷; combining e\u0301 vs é; ligature ﬁne; ½ ⅓ Ⅻ １２３ ٣.\n"
    "\tTabs\tand  double  spaces,\r\nwindows lines\n\n\nit's they'll we'd I'M YOU'RE.   \n"
    "def f(x):\n    return x ** 2  # code 12345678 3.14159\n"
)
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
BYTES = [f"<0x{b:02X}>" for b in range(256)]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def corpus_text():
    licenses = [f for f in sorted(glob.glob("/usr/share/common-licenses/*")) if os.path.isfile(f)][:4]
    text = "".join(open(p, encoding="utf-8", errors="replace").read() for p in licenses)
    return text + MULTILINGUAL * 20


def write_corpus(path):
    with open(path, "w", encoding="utf-8") as f:
        f.write(corpus_text())
    return path


def trained_bpe(corpus, pre_tokenizer, vocab_size, specials=(), byte_level=False, **model_args):
    """(vocab, merges) of a BPE trained on the corpus file with this pre-tokenizer."""
    tok = Tokenizer(models.BPE(**model_args))
    tok.pre_tokenizer = pre_tokenizer
    kwargs = {k: v for k, v in model_args.items() if k in ("continuing_subword_prefix", "end_of_word_suffix")}
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [], **kwargs)
    tok.train([corpus], trainer)
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def with_bytes_first(vocab, specials):
    """A SentencePiece-style vocabulary: specials, then <0x00>..<0xFF>, then the learned tokens."""
    out = {t: i for i, t in enumerate(list(specials) + BYTES)}
    for token in sorted(vocab, key=vocab.get):
        out.setdefault(token, len(out))
    return out


def metaspace_vocab(corpus, specials, vocab_size=900):
    vocab, merges = trained_bpe(corpus, pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"), vocab_size,
                                specials=specials)
    return with_bytes_first(vocab, specials), merges


def template_file(name):
    return open(os.path.join(CHAT_TEMPLATES, name), encoding="utf-8").read()


def mistral_tokenizer(corpus, out):
    """Mistral v0.3's shape: Metaspace BPE with byte fallback, <s> before each sequence, [INST] turns."""
    vocab, merges = metaspace_vocab(corpus, ["<unk>", "<s>", "</s>"])
    tok = transformers.LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    tok.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]"]})
    tok.chat_template = template_file("mistral_v3.jinja")
    tok.save_pretrained(out)
    return tok


def qwen2_tokenizer(corpus, out):
    """Qwen2's shape: byte-level BPE with its pattern, no template tokens, ChatML turns ending at <|im_end|>."""
    pattern = transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    vocab, merges = trained_bpe(corpus, split, 900, specials=["<|endoftext|>"], byte_level=True)
    tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template_file("qwen2_5.jinja")
    tok.save_pretrained(out)
    return tok


def llama3_tokenizer(corpus, out, vocab_size=900, chat_template=True):
    """A Llama 3 shaped tokenizer saved in `out`; returns transformers' tokenizer for it."""
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    vocab, merges = trained_bpe(corpus, split, vocab_size, byte_level=True)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = split
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIALS])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                      special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                                eos_token="<|eot_id|>")
    if chat_template:
        fast.chat_template = template_file("llama3.jinja")
    fast.save_pretrained(out)
    return fast


def tiny_llama(out, tokenizer, context=256, hidden=64, layers=2, seed=0, vocab=None):
    """A random Llama over the tokenizer's vocabulary (or `vocab` rows),
    saved beside it, with a generation_config.json naming Llama 3
    Instruct's end ids."""
    torch.manual_seed(seed)
    vocab = vocab or len(tokenizer)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=context,
                                      bos_token_id=tokenizer.convert_tokens_to_ids("<|begin_of_text|>"),
                                      eos_token_id=[tokenizer.convert_tokens_to_ids(t)
                                                    for t in ("<|end_of_text|>", "<|eot_id|>")])
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    return model


def tiny_family_model(family, out, tokenizer, eos_tokens, vocab=None, context=256, hidden=64, seed=0):
    """A random "mistral" (no sliding window) or "qwen2" (q, k, v biases) model over the tokenizer's
    vocabulary (or `vocab` rows), saved beside it, with generation_config.json naming `eos_tokens`."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                  eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in eos_tokens])
    if family == "mistral":
        config = transformers.MistralConfig(sliding_window=None, bos_token_id=tokenizer.convert_tokens_to_ids("<s>"),
                                            **common)
        model = transformers.MistralForCausalLM(config)
    else:
        config = transformers.Qwen2Config(use_sliding_window=False, bos_token_id=None, **common)
        model = transformers.Qwen2ForCausalLM(config)
    model.eval()
    with torch.no_grad():  # random norms and biases too, so a swapped or missing one shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    return model
