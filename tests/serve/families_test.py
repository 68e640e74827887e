"""A Mistral-style and a Qwen2-style model end to end, as a user takes them:
each a tiny random model saved by transformers with its tokenizer (Mistral:
Metaspace BPE with byte fallback and <s>; Qwen2: byte-level BPE, ChatML,
q/k/v biases, a vocabulary padded past the tokenizer's), chat template and
generation_config.json, imported with `meshtrain import hf` and served.
Echoed prompt logprobs equal transformers'; chat through the official
openai client (plain and streamed) equals transformers' greedy generation of
the templated conversation and stops at the family's end of turn;
lm-evaluation-harness' local-completions scores a multiple-choice task as
its hf backend does on the same folder. The Qwen2 model is also served
split over 2 ranks (its q/k/v biases split with their heads).

usage: families_test.py MESHTRAIN
"""
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from hf_fixtures import mistral_tokenizer, qwen2_tokenizer, tiny_family_model, write_corpus  # noqa: E402
from lm_eval_tasks import LmEval  # noqa: E402
import serving  # noqa: E402

MESHTRAIN = sys.argv[1]
CHECKS = Checks(MESHTRAIN)
check, meshtrain = CHECKS.check, CHECKS.meshtrain
TEXT = "The licence grants you the right to copy, modify and share. Le café est très bon."
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a licence?"}]

# family: (tokenizer builder, end-of-turn tokens, extra vocabulary rows, BOS before a prompt)
FAMILIES = {
    "mistral": (mistral_tokenizer, ["</s>"], 0, True),
    "qwen2": (qwen2_tokenizer, ["<|im_end|>", "<|endoftext|>"], 14, False),
}


def echoed_logprobs(server, model, tokenizer, what):
    status, out = serving.post(server.url, {"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 1})
    ids = tokenizer(TEXT).input_ids
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    got = out["choices"][0]["logprobs"]["token_logprobs"] if status == 200 else []
    worst = max(abs(got[i] - want[i - 1, ids[i]].item()) for i in range(1, len(ids))) if len(got) == len(ids) else 1.0
    check(status == 200 and worst < 1e-4,
          f"{what}: echoed logprobs of {len(ids)} prompt tokens equal transformers' (max difference {worst:.1e})")


def chat(server, model, tokenizer, eos_tokens, family):
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in eos_tokens]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    want = tokenizer.decode([t for t in new if t not in eos])
    client = server.client()
    got = client.chat.completions.create(model="meshtrain", messages=MESSAGES, max_tokens=24, temperature=0)
    reason = "stop" if new and new[-1] in eos else "length"
    check(got.choices[0].message.content == want and got.choices[0].finish_reason == reason
          and got.usage.prompt_tokens == len(ids),
          f"{family}: openai client chat equals transformers' greedy generation of the templated conversation "
          f"({reason}, {len(new)} tokens)")
    chunks = list(client.chat.completions.create(model="meshtrain", messages=MESSAGES, max_tokens=24, temperature=0,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(text == want, f"{family}: streamed chat gives the same text")
    if family == "mistral":  # its template offers tools; tool_choice "none" offers none
        tools = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        offered = [client.chat.completions.create(model="meshtrain", messages=MESSAGES, max_tokens=1, temperature=0,
                                                  tools=tools, tool_choice=choice).usage.prompt_tokens
                   for choice in ("auto", "none")]
        check(offered[0] > len(ids) and offered[1] == len(ids),
              f"{family}: tools reach the template ({offered[0]} prompt tokens), not with tool_choice none "
              f"({offered[1]}, as without tools: {len(ids)})")
    got = client.chat.completions.create(model="meshtrain", messages=MESSAGES, max_tokens=24, temperature=0,
                                         logit_bias={str(eos[0]): 100})
    check(got.choices[0].message.content == "" and got.choices[0].finish_reason == "stop",
          f"{family}: a chat answer ends at {eos_tokens[0]} (generation_config.json's end ids)")


def scored_by_lm_eval(lm, server, hf_dir, bos, family):
    args = f"add_bos_token={bos}"
    theirs = lm.evaluate(["meshtrain_mc"], "hf", f"pretrained={hf_dir},dtype=float32,device=cpu,{args}", batch_size=1)
    ours = lm.evaluate(["meshtrain_mc"], "local-completions",
                       f"model=meshtrain,base_url={server.url}/v1/completions,num_concurrent=1,"
                       f"tokenizer_backend=huggingface,tokenizer={hf_dir},{args}", batch_size=4)
    lm.compare_mc(ours, theirs, f"{family}: lm-eval local-completions")


def family(name, work, corpus, lm):
    build_tokenizer, eos_tokens, padding, bos = FAMILIES[name]
    hf_dir = os.path.join(work, name)
    tokenizer = build_tokenizer(corpus, hf_dir)
    model = tiny_family_model(name, hf_dir, tokenizer, eos_tokens, vocab=len(tokenizer) + padding)
    checkpoint = os.path.join(work, name + "-imported")
    meshtrain("import", "hf", hf_dir, "--out", checkpoint)
    server = serving.Server(MESHTRAIN, checkpoint)
    try:
        echoed_logprobs(server, model, tokenizer, name)
        chat(server, model, tokenizer, eos_tokens, name)
        scored_by_lm_eval(lm, server, hf_dir, bos, name)
    finally:
        check(server.stop() == 0, f"{name}: the server exits 0")
    return model, tokenizer, checkpoint


def main(work):
    corpus = write_corpus(os.path.join(work, "corpus.txt"))
    lm = LmEval(os.path.join(work, "tasks"), check)
    family("mistral", work, corpus, lm)
    model, tokenizer, checkpoint = family("qwen2", work, corpus, lm)
    server = serving.Server(MESHTRAIN, checkpoint, ranks=2)
    try:
        echoed_logprobs(server, model, tokenizer, "qwen2 on 2 tensor-parallel ranks")
    finally:
        check(server.stop() == 0, "qwen2: the tensor-parallel server exits 0")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        main(work)
    CHECKS.finish()
