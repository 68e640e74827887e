"""Logits of one token sequence from transformers and from meshtrain, for the
interop tests."""
import os

import torch
from safetensors.torch import load_file


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits.float()


def meshtrain_logits(meshtrain, checkpoint, tokens, work):
    """`meshtrain logits` of `tokens` (meshtrain: the Checks runner's command function)."""
    out = os.path.join(work, "logits.safetensors")
    meshtrain("logits", "--checkpoint", checkpoint, "--prompt-ids", ",".join(map(str, tokens)), "--out", out)
    return load_file(out)["logits"]
