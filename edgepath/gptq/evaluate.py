"""Fidelity measurements on a PyTorch model: held-out perplexity and greedy
continuations. Used by the quantization report, the engine check and the
benchmarks."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 4) -> float:
    """exp(mean next-token NLL) over ``windows [W, L]``, each window scored alone."""
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        total += nll.item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


@torch.no_grad()
def greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
