"""Writes examples/sft/shakespeare_chat.jsonl: conversations derived from the
public-domain tiny Shakespeare corpus. Each asks who speaks a line and has
the assistant name the speaker and go on with the next line; one record in
ten is a prompt / completion pair instead. Deterministic: the same corpus
gives the same file.

usage: make_chat_data.py [CORPUS] [OUT] [--count 400]
"""
import argparse
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))


def speeches(text):
    """(speaker, lines) for every speech of two lines or more."""
    out = []
    for block in text.split("\n\n"):
        lines = [line.strip() for line in block.strip().split("\n")]
        if len(lines) >= 3 and lines[0].endswith(":") and lines[0][:-1].replace(" ", "").isalpha():
            out.append((lines[0][:-1].title(), lines[1:]))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", nargs="?", default=os.path.join(HERE, "..", "..", "..", "shared", "data",
                                                                   "tinyshakespeare.txt"))
    parser.add_argument("out", nargs="?", default=os.path.join(HERE, "shakespeare_chat.jsonl"))
    parser.add_argument("--count", type=int, default=400)
    a = parser.parse_args()
    found = speeches(open(a.corpus, encoding="utf-8").read())
    rng = random.Random(1564)
    chosen = rng.sample(found, min(a.count, len(found)))
    with open(a.out, "w", encoding="utf-8") as f:
        for i, (speaker, lines) in enumerate(chosen):
            question = f'Who says "{lines[0]}"?'
            answer = f'{speaker}, who goes on: "{lines[1]}"'
            if i % 10 == 9:
                record = {"prompt": question + "\n", "completion": answer}
            else:
                record = {"messages": [{"role": "system", "content": "You know Shakespeare's plays by heart."},
                                       {"role": "user", "content": question},
                                       {"role": "assistant", "content": answer}]}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{len(chosen)} records to {a.out}")


if __name__ == "__main__":
    main()
