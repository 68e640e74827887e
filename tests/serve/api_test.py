"""The serving API against transformers, on a tiny random Llama with a
Llama 3 shaped tokenizer and chat template, imported with `meshtrain import
hf`: logprobs (echoed prompt, generated tokens, alternatives) equal
log_softmax of transformers' logits and of `meshtrain logits`; prompts as
strings, lists and token ids with n choices; logit_bias and penalties give
what greedy decoding over the adjusted logits gives; chat completions equal
transformers' greedy generation of the templated conversation, stopping at
<|eot_id|>; the tokenizer endpoints; stream usage; unknown fields refused;
and the echoed logprobs once more with weights streamed from host memory
and under tensor parallel on 2 ranks.

usage: api_test.py MESHTRAIN
"""
import json
import os
import sys
import tempfile
import urllib.error
import urllib.request

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from hf_fixtures import llama3_tokenizer, tiny_llama, write_corpus  # noqa: E402
import serving  # noqa: E402

MESHTRAIN = sys.argv[1]
CHECKS = Checks(MESHTRAIN)
check, meshtrain = CHECKS.check, CHECKS.meshtrain
TEXT = "The licence grants you the right to copy, modify and share. Le café est très bon."


def log_softmax_of(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def get(url, path):
    try:
        with urllib.request.urlopen(url + path, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def scoring(server, model, tokenizer, checkpoint, work):
    status, out = serving.post(server.url, {"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 3, "temperature": 0})
    lp = out["choices"][0]["logprobs"] if status == 200 else {}
    ids = tokenizer(TEXT).input_ids
    want = log_softmax_of(model, ids)
    got = lp.get("token_logprobs", [])
    worst = max((abs(got[i] - want[i - 1, ids[i]].item()) for i in range(1, len(ids))), default=1.0) if len(got) == len(ids) else 1.0
    check(status == 200 and got[0] is None and worst < 1e-4,
          f"echo + max_tokens 0 scores {len(ids)} prompt tokens: logprobs equal transformers' (max difference {worst:.1e})")
    logits_file = os.path.join(work, "logits.safetensors")
    meshtrain("logits", "--checkpoint", checkpoint, "--prompt-ids", ",".join(map(str, ids)), "--out", logits_file)
    ours = torch.log_softmax(load_file(logits_file)["logits"][0].double(), -1)
    worst = max(abs(got[i] - ours[i - 1, ids[i]].item()) for i in range(1, len(ids)))
    check(worst < 1e-4, f"... and log_softmax of `meshtrain logits` (max difference {worst:.1e})")
    tops = lp.get("top_logprobs", [None, {}])[1:]
    check(all(len(t) == 3 and abs(max(t.values()) - want[i].max().item()) < 1e-4 for i, t in enumerate(tops)),
          "each position lists its 3 likeliest tokens, the likeliest first")
    spelled = "".join(lp.get("tokens", []))
    check(spelled == tokenizer.decode(ids) and lp["text_offset"][-1] == len(spelled) - len(lp["tokens"][-1]),
          "the tokens spell the prompt and text_offset counts characters")


def generation(server, model, tokenizer):
    prompt_ids = tokenizer("Licence").input_ids
    status, out = serving.post(server.url, {"prompt": "Licence", "max_tokens": 6, "temperature": 0, "logprobs": 2})
    choice = out["choices"][0]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0].tolist()
    ids = greedy
    want = log_softmax_of(model, ids)
    got = choice["logprobs"]["token_logprobs"]
    worst = max(abs(got[k] - want[len(prompt_ids) - 1 + k, ids[len(prompt_ids) + k]].item()) for k in range(len(got)))
    check(status == 200 and choice["text"] == tokenizer.decode(greedy[len(prompt_ids):]) and worst < 1e-4,
          f"greedy text equals transformers' and each token's logprob its log_softmax (max difference {worst:.1e})")
    check(all(abs(max(t.values()) - g) < 1e-9 for t, g in zip(choice["logprobs"]["top_logprobs"], got)),
          "greedy tokens are their position's likeliest (what lm-eval's is_greedy checks)")

    # Prompt forms and n: a list of strings, token ids, a list of id lists.
    status, out = serving.post(server.url, {"prompt": ["Licence", "Le café"], "n": 2, "max_tokens": 4, "temperature": 0})
    texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    check(status == 200 and len(texts) == 4 and texts[0] == texts[1] == choice["text"][:len(texts[0])] and texts[2] == texts[3],
          "two prompts with n = 2 give four choices, indexed in order")
    status, by_ids = serving.post(server.url, {"prompt": prompt_ids, "max_tokens": 6, "temperature": 0})
    status2, by_lists = serving.post(server.url, {"prompt": [prompt_ids, prompt_ids[:2]], "max_tokens": 6, "temperature": 0})
    check(status == 200 and by_ids["choices"][0]["text"] == choice["text"] and status2 == 200
          and by_lists["choices"][0]["text"] == choice["text"] and len(by_lists["choices"]) == 2,
          "token-id prompts (one, or a list of lists) continue as the text prompt does")
    status, sampled = serving.post(server.url, {"prompt": "Licence", "max_tokens": 8, "temperature": 1, "n": 3, "seed": 5})
    texts = [c["text"] for c in sampled["choices"]]
    check(status == 200 and len(set(texts)) > 1, f"n = 3 samples differ from each other ({len(set(texts))} distinct)")

    # logit_bias and penalties: greedy over the adjusted logits, as computed here.
    target = tokenizer.convert_tokens_to_ids("Ġthe") if "Ġthe" in tokenizer.get_vocab() else 300
    status, out = serving.post(server.url, {"prompt": "Licence", "max_tokens": 3, "temperature": 0,
                                            "logit_bias": {str(target): 100}})
    check(status == 200 and tokenizer(out["choices"][0]["text"], add_special_tokens=False).input_ids == [target] * 3,
          "logit_bias +100 makes its token the greedy choice")
    for penalty in ({"frequency_penalty": 1.5}, {"presence_penalty": 2.0}):
        ids, counts = list(prompt_ids), {}
        for _ in range(8):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].double()
            for t, n in counts.items():
                logits[t] -= penalty.get("presence_penalty", 0) + penalty.get("frequency_penalty", 0) * n
            nxt = int(logits.argmax())
            counts[nxt] = counts.get(nxt, 0) + 1
            ids.append(nxt)
        want = tokenizer.decode(ids[len(prompt_ids):])
        status, out = serving.post(server.url, {"prompt": "Licence", "max_tokens": 8, "temperature": 0, **penalty})
        check(status == 200 and out["choices"][0]["text"] == want, f"{penalty} gives greedy over penalized logits")


def chat(server, model, tokenizer):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a licence?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    want = tokenizer.decode([t for t in new if t not in eos], skip_special_tokens=True)
    client = server.client()
    got = client.chat.completions.create(model="meshtrain", messages=messages, max_tokens=20, temperature=0,
                                         logprobs=True, top_logprobs=2)
    reason = "stop" if new and new[-1] in eos else "length"
    check(got.choices[0].message.content == want and got.choices[0].finish_reason == reason
          and got.usage.prompt_tokens == len(ids),
          f"chat equals transformers' greedy generation of the templated conversation ({reason}, {len(new)} tokens)")
    content = got.choices[0].logprobs.content
    check(len(content) == len([t for t in new if t not in eos]) and all(len(c.top_logprobs) == 2 for c in content),
          "chat logprobs: one entry per token of the answer, with 2 alternatives")
    chunks = list(client.chat.completions.create(model="meshtrain", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(text == want and chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == len(new)
          and not chunks[-1].choices, "streamed chat: the same text, role first, usage last")
    # Long generation stops at <|eot_id|> when the model emits it: bias it in.
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    got = client.chat.completions.create(model="meshtrain", messages=messages, max_tokens=20, temperature=0,
                                         logit_bias={str(eot): 100})
    check(got.choices[0].message.content == "" and got.choices[0].finish_reason == "stop",
          "a chat answer ends at <|eot_id|> (generation_config's end ids)")
    # Special tokens are left out of the text unless asked for (skip_special_tokens, vLLM's default true).
    header = tokenizer.convert_tokens_to_ids("<|start_header_id|>")
    got = [client.chat.completions.create(model="meshtrain", messages=messages, max_tokens=3, temperature=0,
                                          logit_bias={str(header): 100}, **extra).choices[0].message.content
           for extra in ({}, {"extra_body": {"skip_special_tokens": False}})]
    check(got == ["", "<|start_header_id|>" * 3], f"special tokens skipped by default, kept when asked: {got}")


def endpoints(server, tokenizer):
    text = "Hello<|eot_id|> world"
    status, out = serving.post(server.url, {"prompt": text}, path="/tokenize")
    check(status == 200 and out["tokens"] == tokenizer(text).input_ids and out["count"] == len(out["tokens"]),
          "/tokenize gives transformers' ids (the template's <|begin_of_text|> and the special token in the text)")
    status, strs = serving.post(server.url, {"prompt": text, "return_token_strs": True}, path="/tokenize")
    check(status == 200 and strs["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
          and out["token_strs"] is None, "/tokenize with return_token_strs spells each id as the vocabulary does")
    status, back = serving.post(server.url, {"tokens": out["tokens"]}, path="/detokenize")
    check(status == 200 and back["prompt"] == tokenizer.decode(out["tokens"]), "/detokenize gives the text back")
    status, info = get(server.url, "/tokenizer_info")
    check(status == 200 and info["eos_token"] == "<|eot_id|>" and "start_header_id" in info["chat_template"],
          "/tokenizer_info names the end token and carries the chat template")
    messages = [{"role": "user", "content": "Hi"}]
    status, out = serving.post(server.url, {"messages": messages}, path="/tokenize")
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    check(status == 200 and out["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want),
          "/tokenize of messages equals apply_chat_template")
    check(get(server.url, "/v1/models/meshtrain")[0] == 200 and get(server.url, "/v1/models/other")[0] == 404,
          "GET /v1/models/{name}: 200 for the served model, 404 for another")
    status, out = serving.post(server.url, {"prompt": "x", "max_tokens": 2, "logprob": 2})
    check(status == 400 and out["error"]["param"] == "logprob" and "unknown field 'logprob'" in out["error"]["message"],
          "an unknown field is refused, named: " + out.get("error", {}).get("message", "")[:60])
    for field, body in [("stream_options", {"stream": True, "stream_options": {"continuous_usage_stats": True}}),
                        ("parallel_tool_calls", {"parallel_tool_calls": False})]:
        status, out = serving.post(server.url, {"messages": messages, **body}, path="/v1/chat/completions")
        check(status == 400 and out["error"]["param"] == field, f"{field} (not carried out) is refused, not ignored: "
              + out.get("error", {}).get("message", "")[:70])
    status, out = serving.post(server.url, {"messages": [{"role": "user"}]}, path="/v1/chat/completions")
    check(status == 400 and "content" in out["error"]["message"], "a message without content is refused")
    chunks = list(server.client().completions.create(model="meshtrain", prompt="Licence", max_tokens=3, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3 and not chunks[-1].choices,
          "stream_options.include_usage ends the stream with the usage")


def echo_logprobs_equal(server, model, tokenizer, what):
    status, out = serving.post(server.url, {"prompt": TEXT, "max_tokens": 2, "echo": True, "logprobs": 2,
                                            "temperature": 0})
    ids = tokenizer(TEXT).input_ids
    want = log_softmax_of(model, ids)
    got = out["choices"][0]["logprobs"]["token_logprobs"] if status == 200 else [None]
    worst = max(abs(got[i] - want[i - 1, ids[i]].item()) for i in range(1, len(ids))) if len(got) > 1 else 1.0
    check(worst < 1e-4, f"{what}: echoed logprobs equal transformers' (max difference {worst:.1e})")


def main(work):
    corpus = write_corpus(os.path.join(work, "corpus.txt"))
    hf_dir = os.path.join(work, "hf")
    tokenizer = llama3_tokenizer(corpus, hf_dir)
    model = tiny_llama(hf_dir, tokenizer)
    checkpoint = os.path.join(work, "imported")
    meshtrain("import", "hf", hf_dir, "--out", checkpoint)
    server = serving.Server(MESHTRAIN, checkpoint)
    try:
        scoring(server, model, tokenizer, checkpoint, work)
        generation(server, model, tokenizer)
        chat(server, model, tokenizer)
        endpoints(server, tokenizer)
    finally:
        check(server.stop() == 0, "the server exits 0")
    # Weights streamed from host memory block by block (ZeRO-Inference) score alike.
    server = serving.Server(MESHTRAIN, checkpoint, "--offload.weights=cpu")
    try:
        echo_logprobs_equal(server, model, tokenizer, "weights streamed from host memory")
    finally:
        check(server.stop() == 0, "the server streaming its weights exits 0")
    # Split by 2 ranks, the vocabulary is padded to an even size (as models ship them).
    tp_dir = os.path.join(work, "hf-padded")
    tokenizer.save_pretrained(tp_dir)
    model = tiny_llama(tp_dir, tokenizer, vocab=len(tokenizer) + 7)
    checkpoint = os.path.join(work, "imported-padded")
    meshtrain("import", "hf", tp_dir, "--out", checkpoint)
    server = serving.Server(MESHTRAIN, checkpoint, ranks=2)
    try:
        echo_logprobs_equal(server, model, tokenizer, "tensor parallel on 2 ranks")
    finally:
        check(server.stop() == 0, "the tensor-parallel server exits 0")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        main(work)
    CHECKS.finish()
