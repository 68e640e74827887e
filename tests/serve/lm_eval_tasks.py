"""Two small lm-evaluation-harness tasks over local JSONL files, as a user
writes them (a multiple-choice task scored by loglikelihoods, a
generate_until task), and comparisons of two runs' per-sample responses."""
import json
import logging
import os

import lm_eval
from lm_eval.tasks import TaskManager

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
    """meshtrain_mc and meshtrain_gen in `folder`; their TaskManager."""
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


def responses(result, task):
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


class LmEval:
    """The tasks written to `folder`; `check(ok, what)` reports each comparison."""

    def __init__(self, folder, check):
        self.tasks, self.check = write_tasks(folder), check

    def evaluate(self, tasks, model, model_args, **kwargs):
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=self.tasks,
                                       log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                       fewshot_random_seed=0, **kwargs)

    def compare_mc(self, ours, theirs, what):
        a, b = responses(ours, "meshtrain_mc"), responses(theirs, "meshtrain_mc")
        worst = max(abs(float(x[0][0]) - float(y[0][0])) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
        greedy = all(bool(x[0][1]) == bool(y[0][1]) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
        acc = ours["results"]["meshtrain_mc"]["acc,none"], theirs["results"]["meshtrain_mc"]["acc,none"]
        self.check(len(a) == len(QUESTIONS) and worst < 1e-3 and greedy and acc[0] == acc[1],
                   f"{what}: multiple choice - acc {acc[0]:.3f} as the hf backend's, loglikelihoods within "
                   f"{worst:.1e}, is_greedy alike")

    def compare_gen(self, ours, theirs, what):
        a, b = responses(ours, "meshtrain_gen"), responses(theirs, "meshtrain_gen")
        same = sum(x == y for x, y in zip(a, b))
        self.check(len(a) == len(QUESTIONS) and same == len(a),
                   f"{what}: generate_until - {same}/{len(a)} generations equal the hf backend's ({a[0][0][0]!r})")
