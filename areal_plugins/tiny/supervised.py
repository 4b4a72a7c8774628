"""The supervised loss of the tiny models' warm starts."""

from __future__ import annotations


def answer_loss(model, input_ids, attention_mask, labels):
    """Next-token cross-entropy on the labelled positions only (what ``labels=`` computes in HF).

    The vocabulary projection runs on the answer positions alone: with long, padded answers
    (the long-tail workload) projecting every position made the warm start several times slower.
    """
    import torch

    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])
