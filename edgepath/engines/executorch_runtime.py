"""ExecuTorch's runtime running a KV-cache decoder ``.pte`` (the XNNPACK export).

The program's one method is ``forward(input_ids [1, 1] int64, cache_position [1]
int64) -> logits [1, 1, vocab]``; its KV cache lives in the program's mutable
buffers, so a loaded method keeps state between calls. A sequence starts again at
position 0 without clearing the cache: each step writes its own position and the
causal mask built from ``cache_position`` hides every later one. Operators outside
XNNPACK (the int8 embedding lookup; the custom ops of a ``--use_custom_sdpa``
export) are registered by importing their kernel libraries before the program is
loaded.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..errors import EdgepathError


def _register_kernels() -> None:
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama custom ops)
    import executorch.kernels.quantized  # noqa: F401  (quantized_decomposed::embedding_byte & co.)


def set_threads(n: int) -> None:
    """XNNPACK's thread pool size for this process."""
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    _unsafe_reset_threadpool(n)


class PteDecoder:
    def __init__(self, path: Path, max_seq_len: int) -> None:
        from executorch.runtime import Runtime

        path = Path(path)
        if not path.is_file() or path.stat().st_size == 0:
            raise EdgepathError(f"{path}: no ExecuTorch program there")
        _register_kernels()
        try:
            self._program = Runtime.get().load_program(path)
            self._method = self._program.load_method("forward")
        except Exception as e:  # a truncated or foreign file fails inside the runtime
            raise EdgepathError(f"{path}: ExecuTorch cannot load it as a program ({e}); rebuild it") from e
        self.path, self.max_seq_len, self.position = path, max_seq_len, 0

    def reset(self) -> None:
        """Start a new sequence: the next token is at position 0 (module docstring)."""
        self.position = 0

    def step(self, token: int) -> torch.Tensor:
        """Feed ``token`` at the next position; its next-token logits ``[vocab]``."""
        if self.position >= self.max_seq_len:
            raise EdgepathError(f"{self.path}: the KV cache holds {self.max_seq_len} positions")
        out = self._method.execute((torch.tensor([[token]], dtype=torch.long),
                                    torch.tensor([self.position], dtype=torch.long)))
        self.position += 1
        return out[0].reshape(-1)

    def logits(self, ids: list[int]) -> torch.Tensor:
        """``[len(ids), vocab]`` teacher-forced from position 0."""
        self.reset()
        return torch.stack([self.step(t) for t in ids])

    def _feed(self, prompt: list[int]) -> int:
        """A new sequence holding ``prompt`` but its last token, which is returned: the
        first step of decoding feeds it."""
        self.reset()
        for t in prompt[:-1]:
            self.step(t)
        return prompt[-1]

    def _decode(self, token: int, new_tokens: int) -> list[int]:
        out = []
        for _ in range(new_tokens):
            token = int(self.step(token).argmax())
            out.append(token)
        return out

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        return self._decode(self._feed(prompt), new_tokens)

    def decode_seconds_per_token(self, prompt: list[int], tokens: int, rounds: int) -> list[float]:
        """Per round: seconds per decoded token after feeding ``prompt`` (not timed)."""
        per_round = []
        for _ in range(rounds):
            token = self._feed(prompt)
            started = time.perf_counter()
            self._decode(token, tokens)
            per_round.append((time.perf_counter() - started) / tokens)
        return per_round


def median_tok_s(seconds_per_token: list[float]) -> dict[str, float]:
    rates = [1 / s for s in seconds_per_token]
    return {"median": round(statistics.median(rates), 2), "min": round(min(rates), 2), "max": round(max(rates), 2)}
