"""lm-evaluation-harness against `meshtrain serve`: a local multiple-choice
task (loglikelihoods through echoed logprobs) and a local generate_until
task, run with local-completions (the Hugging Face tokenizer, batches of 4
prompts per request) and with the server's own tokenizer endpoints (the
remote tokenizer), and the generation task through local-chat-completions;
every score, loglikelihood and generated text equals what lm-eval's hf
backend gives on the model `meshtrain export hf` writes.

usage: lm_eval_test.py MESHTRAIN
"""
import json
import logging
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from hf_fixtures import llama3_tokenizer, tiny_llama, write_corpus  # noqa: E402
import serving  # noqa: E402

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

MESHTRAIN = sys.argv[1]
CHECKS = Checks(MESHTRAIN)
check, meshtrain = CHECKS.check, CHECKS.meshtrain
logging.getLogger("lm-eval").setLevel(logging.WARNING)

QUESTIONS = [
    ("Which word names a drink?", ["café", "licence", "river", "stone"], 0),
    ("The licence lets you", ["copy the work", "eat the work", "fly", "sleep"], 0),
    ("Tokyo is in", ["Japan", "France", "Peru", "Chad"], 0),
    ("2 + 2 =", ["4", "5", "22", "0"], 0),
    ("Straße is a word in", ["German", "Thai", "Korean", "Greek"], 0),
    ("Pick the emoji", ["😀", "a", "b", "c"], 0),
]


def write_tasks(folder):
    """Two tasks over local JSONL files, as a user writes them."""
    os.makedirs(folder)
    with open(os.path.join(folder, "mc.jsonl"), "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}, ensure_ascii=False) + "\n")
    with open(os.path.join(folder, "gen.jsonl"), "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "answer": choices[answer]}, ensure_ascii=False) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    with open(os.path.join(folder, "meshtrain_mc.yaml"), "w") as f:
        f.write(f"task: meshtrain_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder}/mc.jsonl\n"
                "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
                "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    with open(os.path.join(folder, "meshtrain_gen.yaml"), "w") as f:
        f.write(f"task: meshtrain_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder}/gen.jsonl\n"
                "output_type: generate_until\ndoc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_target: answer\n"
                "generation_kwargs:\n  until: [\"\\n\\n\", \"Q:\"]\n  max_gen_toks: 12\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n")
    return TaskManager(include_path=folder)


def evaluate(tasks, model, model_args, **kwargs):
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=TASKS,
                                  log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0, **kwargs)
    return out


def responses(result, task):
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def compare_mc(ours, theirs, what):
    a, b = responses(ours, "meshtrain_mc"), responses(theirs, "meshtrain_mc")
    worst = max(abs(float(x[0][0]) - float(y[0][0])) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    greedy = all(bool(x[0][1]) == bool(y[0][1]) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    acc = ours["results"]["meshtrain_mc"]["acc,none"], theirs["results"]["meshtrain_mc"]["acc,none"]
    check(len(a) == len(QUESTIONS) and worst < 1e-3 and greedy and acc[0] == acc[1],
          f"{what}: multiple choice - acc {acc[0]:.3f} as the hf backend's, loglikelihoods within {worst:.1e}, "
          "is_greedy alike")


def compare_gen(ours, theirs, what):
    a, b = responses(ours, "meshtrain_gen"), responses(theirs, "meshtrain_gen")
    same = sum(x == y for x, y in zip(a, b))
    check(len(a) == len(QUESTIONS) and same == len(a),
          f"{what}: generate_until - {same}/{len(a)} generations equal the hf backend's ({a[0][0][0]!r})")


def main(work):
    global TASKS
    TASKS = write_tasks(os.path.join(work, "tasks"))
    corpus = write_corpus(os.path.join(work, "corpus.txt"))
    hf_dir = os.path.join(work, "hf")
    tokenizer = llama3_tokenizer(corpus, hf_dir)
    tiny_llama(hf_dir, tokenizer)
    checkpoint = os.path.join(work, "imported")
    meshtrain("import", "hf", hf_dir, "--out", checkpoint)
    exported = os.path.join(work, "exported")
    meshtrain("export", "hf", checkpoint, "--out", exported)
    # lm-eval's hf backend and its API models differ on <|begin_of_text|>; each comparison says which.
    reference = f"pretrained={exported},dtype=float32,device=cpu"
    hf = evaluate(["meshtrain_mc", "meshtrain_gen"], "hf", reference + ",add_bos_token=True", batch_size=1)
    hf_no_bos = evaluate(["meshtrain_mc"], "hf", reference + ",add_bos_token=False", batch_size=1)
    hf_chat = evaluate(["meshtrain_gen"], "hf", reference, batch_size=1, apply_chat_template=True)
    server = serving.Server(MESHTRAIN, checkpoint)
    try:
        base = f"model=meshtrain,base_url={server.url}/v1/completions,num_concurrent=1"
        ours = evaluate(["meshtrain_mc", "meshtrain_gen"], "local-completions",
                        f"{base},tokenizer_backend=huggingface,tokenizer={exported},add_bos_token=True", batch_size=4)
        compare_mc(ours, hf, "local-completions, HF tokenizer, batches of 4")
        compare_gen(ours, hf, "local-completions, HF tokenizer, batches of 4")
        remote = evaluate(["meshtrain_mc"], "local-completions", f"{base},tokenizer_backend=remote", batch_size=1)
        compare_mc(remote, hf_no_bos, "local-completions, the server's /tokenize")
        chat = evaluate(["meshtrain_gen"], "local-chat-completions",
                        f"model=meshtrain,base_url={server.url}/v1/chat/completions,num_concurrent=1",
                        apply_chat_template=True)
        compare_gen(chat, hf_chat, "local-chat-completions")
    finally:
        check(server.stop() == 0, "the server exits 0")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        main(work)
    CHECKS.finish()
