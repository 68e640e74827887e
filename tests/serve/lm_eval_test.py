"""lm-evaluation-harness against `meshtrain serve`: a local multiple-choice
task (loglikelihoods through echoed logprobs) and a local generate_until
task, run with local-completions (the Hugging Face tokenizer, batches of 4
prompts per request) and with the server's own tokenizer endpoints (the
remote tokenizer), and the generation task through local-chat-completions;
every score, loglikelihood and generated text equals what lm-eval's hf
backend gives on the model `meshtrain export hf` writes.

usage: lm_eval_test.py MESHTRAIN
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from hf_fixtures import llama3_tokenizer, tiny_llama, write_corpus  # noqa: E402
import serving  # noqa: E402
from lm_eval_tasks import LmEval  # noqa: E402

MESHTRAIN = sys.argv[1]
CHECKS = Checks(MESHTRAIN)
check, meshtrain = CHECKS.check, CHECKS.meshtrain


def main(work):
    lm = LmEval(os.path.join(work, "tasks"), check)
    evaluate, compare_mc, compare_gen = lm.evaluate, lm.compare_mc, lm.compare_gen
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
