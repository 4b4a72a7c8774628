"""Supervised warm starts of the tiny models: the loop, and its loss on the labelled tokens only."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)

#: One training sequence: its token ids and its labels (-100 where no loss is taken).
Example = tuple[list[int], list[int]]


def warm_start(
    model: Any,
    batches: Iterable[list[Example]],
    steps: int,
    lr: float,
    pad_id: int,
    task: str,
    more_inputs: Callable[[int, Any], dict[str, Any]] | None = None,
) -> dict:
    """AdamW steps over ``batches`` (right-padded per batch), the loss on the labelled tokens only.

    ``more_inputs(step, input_ids)``: what else the model's forward takes for that step's batch (a vision-language
    model's pixels)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss_value = float("nan")
    for step, batch in enumerate(batches):
        width = max(len(ids) for ids, _ in batch)
        ids_t = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in batch])
        labels_t = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        mask_t = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        extra = more_inputs(step, ids_t) if more_inputs is not None else {}
        loss = answer_loss(model, ids_t, mask_t, labels_t, **extra)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
        if step % 10 == 0 or step == steps - 1:
            logger.info("%s warm start step %d/%d loss %.3f", task, step + 1, steps, loss_value)
    model.eval()
    return {"warmstart_final_loss": loss_value}


def answer_loss(model, input_ids, attention_mask, labels, **more_inputs):
    """Next-token cross-entropy on the labelled positions only (what ``labels=`` computes in HF).

    The vocabulary projection runs on the answer positions alone: with long, padded answers
    (the long-tail workload) projecting every position made the warm start several times slower.
    """
    import torch

    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, **more_inputs).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])
