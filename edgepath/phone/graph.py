"""The reference model as the exporters trace it.

``load_reference`` reads the model stage's checkpoint in fp32 from safetensors
(no remote code). ``FullSequence`` is the graph a QNN program holds: a fixed
window of token ids with an explicit additive 4-D causal mask and explicit
``position_ids`` as inputs. Hugging Face derives both from integer arithmetic
on an attention mask inside ``forward``; traced that way, PT2E quantizers
annotate the arithmetic and break (XNNPACK's static quantizer does), so the
graph takes them ready-made, as a static-shape NPU program would anyway.
"""

from __future__ import annotations

from pathlib import Path

import torch


def load_reference(model_dir: Path):
    """The checkpoint as an fp32 ``PreTrainedModel`` in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True,
                                                use_safetensors=True).eval()


class FullSequence(torch.nn.Module):
    """``forward(input_ids [1, L], mask [1, 1, L, L], position_ids [1, L]) -> logits [1, L, V]``."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                          use_cache=False).logits


# What the mask adds where a position may not attend. Not -inf: an observer cannot
# take the range of -inf, and it must stay small beside the attention scores so that
# a 16-bit activation range over (scores + mask) keeps the scores' resolution
# (ExecuTorch's QNN Llama uses the same value); exp(-255) is 0 in fp32 all the same.
MASKED = -255.0


def causal_inputs(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, position_ids) of one window of ``length`` tokens: 0 where a position may
    attend, ``MASKED`` above the diagonal."""
    mask = torch.full((length, length), MASKED).triu(1)[None, None]
    return mask, torch.arange(length)[None]
