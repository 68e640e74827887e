"""The two small lm-evaluation-harness tasks over local JSONL files that
examples/lm_eval ships (a multiple-choice task scored by loglikelihoods, a
generate_until task), and comparisons of two runs' per-sample responses."""
import logging
import os

import lm_eval
from lm_eval.tasks import TaskManager

logging.getLogger("lm-eval").setLevel(logging.WARNING)

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "lm_eval")


def write_tasks(folder):
    """The local tasks examples/lm_eval ships (meshtrain_mc, meshtrain_gen), copied to `folder` with their data
    files named there (the shipped ones name theirs from the repository's root); their TaskManager."""
    os.makedirs(folder)
    for name in os.listdir(EXAMPLES):
        text = open(os.path.join(EXAMPLES, name), encoding="utf-8").read()
        if name.endswith(".yaml"):
            text = text.replace("examples/lm_eval/", folder + "/")
        open(os.path.join(folder, name), "w", encoding="utf-8").write(text)
    return TaskManager(include_path=folder)


QUESTIONS = open(os.path.join(EXAMPLES, "mc.jsonl"), encoding="utf-8").read().splitlines()


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
        # A generation that ends inside a character: transformers decodes its first bytes as one U+FFFD, meshtrain
        # (as vLLM) leaves them out (Note [Text stream]); the rest must be equal, and so must bytes that are no
        # character's start (U+FFFD in both).
        def alike(x, y):
            return x == y or (y.endswith("\ufffd") and x == y[:-1])

        same = sum(all(alike(p, q) for rp, rq in zip(x, y) for p, q in zip(rp, rq)) for x, y in zip(a, b))
        differ = next(((x, y) for x, y in zip(a, b) if x != y), None)  # shown: the first that is not identical
        self.check(len(a) == len(QUESTIONS) and same == len(a),
                   f"{what}: generate_until - {same}/{len(a)} generations equal the hf backend's ({a[0][0][0]!r}"
                   f"{'' if differ is None else f'; ours {differ[0]!r}, theirs {differ[1]!r}'})")
