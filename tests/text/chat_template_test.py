"""Chat templates against transformers' apply_chat_template: the templates
of Llama 3 and 3.1 (tools), Mistral (v0.1 and v0.3 with tools), ChatML /
Qwen2.5 (tools), Gemma and Phi-3, and one that exercises the Jinja
language broadly, each rendered by meshtrain and by transformers for
several conversations, text and token ids; a template's raise_exception
comes back as its message.

usage: chat_template_test.py MESHTRAIN
"""
import json
import os
import subprocess
import sys
import tempfile

import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from checks import Checks  # noqa: E402

MESHTRAIN = sys.argv[1]
CHECKS = Checks(MESHTRAIN)
check = CHECKS.check
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")
SPECIALS = ["<s>", "</s>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "[INST]", "[/INST]", "<|user|>",
            "<|assistant|>", "<|end|>", "<|system|>"]
# Each family's bos / eos as its tokenizer_config.json names them.
FAMILIES = {
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"), "llama3_1": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistral": ("<s>", "</s>"), "mistral_v3": ("<s>", "</s>"), "chatml": (None, "<|im_end|>"),
    "qwen2_5": (None, "<|im_end|>"), "gemma": ("<s>", "</s>"), "phi3": ("<s>", "<|end|>"),
    "language": ("<s>", "</s>"),
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}]
CONVERSATIONS = {
    "alternating": [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": " Hi. How can I help?  "},
                    {"role": "user", "content": "Tell me a joke\nabout cats. 🐈"}],
    "system": [{"role": "system", "content": "  You are terse.\n"}, {"role": "user", "content": "Why is the sky blue?"},
               {"role": "assistant", "content": "Rayleigh scattering."}, {"role": "user", "content": "Thanks — merci"}],
    "one turn": [{"role": "user", "content": "x"}],
    "tools": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "tool_calls": [{"id": "call12345", "type": "function", "function": {
                  "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
              {"role": "tool", "tool_call_id": "call12345", "content": "22 degrees"},
              {"role": "assistant", "content": "It is 22 degrees in Paris."}, {"role": "user", "content": "And Rome?"}],
    "not alternating": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}
# Which conversations each template takes (some refuse a system role or tools by design).
SKIP = {"gemma": {"system", "tools"}, "mistral": {"system", "tools"}, "llama3": {"tools"}, "chatml": {"tools"},
        "phi3": {"tools"}, "language": set()}


def tokenizer_folder(work, name, template):
    """A small tokenizer with the family's special tokens and this chat template."""
    folder = os.path.join(work, name)
    if not os.path.exists(os.path.join(work, "base.json")):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        text = json.dumps(CONVERSATIONS) + open(os.path.join(TEMPLATES, "llama3_1.jinja")).read()
        tok.train_from_iterator([text] * 4, trainers.BpeTrainer(
            vocab_size=600, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
        tok.save(os.path.join(work, "base.json"))
    bos, eos = FAMILIES[name]
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(work, "base.json"), bos_token=bos,
                                                eos_token=eos)
    fast.chat_template = template
    fast.save_pretrained(folder)
    return folder, fast


def ours(folder, messages_path, generation_prompt, tools_path=None, ids=False):
    args = [MESHTRAIN, "tokenizer", "chat", "--tokenizer", folder, "--messages", messages_path]
    args += (["--generation-prompt"] if generation_prompt else []) + (["--tools", tools_path] if tools_path else [])
    args += ["--ids"] if ids else []
    out = subprocess.run(args, capture_output=True)
    return out.returncode, out.stdout.decode("utf-8"), out.stderr.decode("utf-8")


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"at {i}: {a[max(0, i - 20):i + 20]!r} vs {b[max(0, i - 20):i + 20]!r}"
    return f"lengths {len(a)} vs {len(b)}"


def ours_batch(folder, cases_path):
    """Every case of a .jsonl file rendered by one meshtrain process, with ids: a JSON line each."""
    out = subprocess.run([MESHTRAIN, "tokenizer", "chat", "--tokenizer", folder, "--messages", cases_path, "--ids"],
                         capture_output=True)
    rows = [json.loads(line) for line in out.stdout.decode("utf-8").splitlines()] if out.returncode == 0 else []
    return out.returncode, rows, out.stderr.decode("utf-8")


def check_template(work, name):
    template = open(os.path.join(TEMPLATES, name + ".jinja"), encoding="utf-8").read()
    folder, fast = tokenizer_folder(work, name, template)
    cases = []  # (conversation, messages, tools, generation prompt)
    for conv_name, messages in CONVERSATIONS.items():
        if conv_name not in SKIP.get(name, set()):
            for generation_prompt in (False, True):
                cases.append((conv_name, messages, TOOLS if conv_name == "tools" else None, generation_prompt))
    cases_path = os.path.join(work, f"{name}-cases.jsonl")
    with open(cases_path, "w", encoding="utf-8") as f:
        for _, messages, tools, generation_prompt in cases:
            line = {"messages": messages, "add_generation_prompt": generation_prompt}
            if tools:
                line["tools"] = tools
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    rc, rows, err = ours_batch(folder, cases_path)
    if rc != 0 or len(rows) != len(cases):
        return check(False, f"{name}: meshtrain rendered {len(rows)} of {len(cases)} conversations: {err.strip()}")
    differences = []
    for (conv_name, messages, tools, generation_prompt), row in zip(cases, rows):
        try:
            want = fast.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # the template refused: so must meshtrain, saying the same
            if "error" not in row or str(e) not in row["error"]:
                differences.append(f"{conv_name}: transformers raised {e!r}, meshtrain: {row}")
            continue
        if row.get("text") != want:
            differences.append(f"{conv_name} (generation prompt {generation_prompt}): "
                               + (row["error"] if "error" in row else first_difference(row["text"], want)))
        elif generation_prompt:
            want_ids = fast.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
            want_ids = want_ids["input_ids"] if isinstance(want_ids, dict) or hasattr(want_ids, "keys") else want_ids
            if row["ids"] != list(want_ids):
                differences.append(f"{conv_name}: token ids differ")
    # One conversation as a plain JSON file, as a person renders one: the same text and ids.
    conv_name, messages, tools, _ = cases[-1]
    path = os.path.join(work, f"{name}-one.json")
    json.dump(messages, open(path, "w"), ensure_ascii=False)
    tools_path = os.path.join(work, "tools.json")
    json.dump(TOOLS, open(tools_path, "w"))
    rc, got, err = ours(folder, path, True, tools_path if tools else None)
    rc_ids, got_ids, _ = ours(folder, path, True, tools_path if tools else None, ids=True)
    if "error" not in rows[-1] and (rc != 0 or got != rows[-1]["text"] or rc_ids != 0
                                    or [int(t) for t in got_ids.split()] != rows[-1]["ids"]):
        differences.append(f"{conv_name}: a plain JSON file renders otherwise than its line: {err.strip()}")
    check(not differences, f"{name}: {len(cases)} renderings equal transformers' apply_chat_template"
          + ("" if not differences else "; " + "; ".join(differences[:3])))


def main(work):
    for name in FAMILIES:
        check_template(work, name)
    # A template that does not parse is refused when it is read, naming the line.
    folder, _ = tokenizer_folder(work, "language", "{% for m in messages %}{{ m.content }\n{% endfor %}")
    path = os.path.join(work, "one.json")
    json.dump(CONVERSATIONS["one turn"], open(path, "w"))
    rc, _, err = ours(folder, path, False)
    check(rc == 1 and "line 1" in err, "a broken template is refused naming its line: " + err.strip()[-100:])


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        main(work)
    CHECKS.finish()
