"""ExecuTorch's runtime running a KV-cache decoder ``.pte`` (the XNNPACK export).

The program's one method is ``forward(tokens [1, S] int64, input_pos [1] int64) ->
logits [1, 1, vocab]`` of the last of the S tokens, placed at positions
``input_pos ..``; S is dynamic, so a prompt is prefilled in one call
(``phone.xnnpack.CustomOpsDecoder``). Its KV cache lives in the program's
mutable buffers, so a loaded method keeps state between calls. A sequence starts
again at position 0 without clearing the cache: each call writes its own positions
and the causal attention reads none past them. Operators outside XNNPACK (the int8
embedding lookup; ExecuTorch's LLM ops ``llama::update_cache`` and
``llama::custom_sdpa``) are registered by importing their kernel libraries before
the program is loaded.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..core.errors import EdgepathError
from ..scoring.stats import spread


def _register_kernels() -> None:
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama custom ops)
    import executorch.kernels.quantized  # noqa: F401  (quantized_decomposed::embedding_byte & co.)


def set_threads(n: int) -> None:
    """XNNPACK's thread pool size for this process."""
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    _unsafe_reset_threadpool(n)


class PteDecoder:
    """``path``'s program with a KV cache of ``max_seq_len`` positions. With
    ``one_token_per_call``, a program whose token input is fixed at ``[1, 1]`` (an
    export before edgepath's custom-ops decoder): prompts are fed token by token."""

    def __init__(self, path: Path, max_seq_len: int, one_token_per_call: bool = False) -> None:
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
        self.path, self.max_seq_len, self.one_token_per_call, self.position = path, max_seq_len, one_token_per_call, 0

    def reset(self) -> None:
        """Start a new sequence: the next token is at position 0 (module docstring)."""
        self.position = 0

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Run ``tokens`` in one call at the next positions (one call each where the
        program takes one token per call); the next-token logits ``[vocab]`` after the
        last of them."""
        if self.one_token_per_call and len(tokens) > 1:
            return [self.feed([t]) for t in tokens][-1]
        if self.position + len(tokens) > self.max_seq_len:
            raise EdgepathError(f"{self.path}: the KV cache holds {self.max_seq_len} positions")
        out = self._method.execute((torch.tensor([tokens], dtype=torch.long),
                                    torch.tensor([self.position], dtype=torch.long)))
        self.position += len(tokens)
        return out[0].reshape(-1)

    def logits(self, ids: list[int]) -> torch.Tensor:
        """``[len(ids), vocab]`` teacher-forced from position 0, one token per call
        (the decode path)."""
        self.reset()
        return torch.stack([self.feed([t]) for t in ids])

    def _decode(self, logits: torch.Tensor, new_tokens: int) -> list[int]:
        out = []
        for _ in range(new_tokens):
            out.append(int(logits.argmax()))
            if len(out) < new_tokens:
                logits = self.feed(out[-1:])
        return out

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """``new_tokens`` greedy tokens after ``prompt``, which is prefilled in one call."""
        self.reset()
        return self._decode(self.feed(prompt), new_tokens)

    def decode_seconds_per_token(self, prompt: list[int], tokens: int, rounds: int) -> list[float]:
        """Per round: seconds per decoded token (``tokens`` calls of one token) after
        prefilling ``prompt`` (not timed)."""
        per_round = []
        for _ in range(rounds):
            self.reset()
            logits = self.feed(prompt)
            started = time.perf_counter()
            self._decode(logits, tokens + 1)
            per_round.append((time.perf_counter() - started) / tokens)
        return per_round

    def prefill_seconds_per_token(self, prompt: list[int], rounds: int) -> list[float]:
        """Per round: seconds per token of prefilling ``prompt`` in one call."""
        per_round = []
        for _ in range(rounds):
            self.reset()
            started = time.perf_counter()
            self.feed(prompt)
            per_round.append((time.perf_counter() - started) / len(prompt))
        return per_round


def median_tok_s(seconds_per_token: list[float]) -> dict[str, float]:
    return spread([1 / s for s in seconds_per_token], 2)
