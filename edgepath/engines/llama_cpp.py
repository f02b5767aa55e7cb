"""llama.cpp through ``llama-cpp-python`` (built from source by ``scripts/setup.sh``):
the benchmark's control engine, and the tools that make its GGUF files.

- The converter (a Hugging Face directory to a GGUF) is llama.cpp's own
  ``convert_hf_to_gguf.py``, which the bindings' wheel does not carry:
  ``formats.gguf_file`` runs it from where set-up put it (``converter_dir``).
- ``quantize_gguf``: F16 GGUF to Q4_K_M / Q4_0 / Q8_0 with ``llama_model_quantize``
  (the bindings expose the quantizer).
- ``importance_matrix`` and ``quantize_with_imatrix``: llama.cpp's ``llama-imatrix``
  and ``llama-quantize --imatrix``, which the bindings cannot drive (the quantizer
  takes the matrix as a C++ map), so set-up builds the two tools from the same sdist
  into ``converter_dir() / "bin"``.
- ``LlamaCpp``: one model in one context, driven through the C API with token
  ids (the caller tokenizes with the model's Hugging Face tokenizer, so every
  engine sees the same ids). Logits are read per position with
  ``llama_get_logits_ith`` after a batch that asked for them: the high-level
  ``Llama(logits_all=True)`` segfaulted on Q4_K_M files (measured here:
  llama-cpp-python 0.3.36 built by ``scripts/build_llama_cpp.sh``, SmolLM2-135M,
  this team's AVX2 build host; issue 5).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.errors import EdgepathError
from ..formats.gguf_file import converter_dir

# GGUF file types the control arms use (llama.h's LLAMA_FTYPE_MOSTLY_*).
FTYPES = {"F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}
# ggml.h's GGML_LOG_LEVEL_WARN and _ERROR (the bindings do not export them).
_LOG_WARN, _LOG_ERROR = 2, 3


def tool(name: str) -> Path:
    """One of llama.cpp's command-line tools that set-up built (``llama-imatrix``, ``llama-quantize``)."""
    path = converter_dir() / "bin" / name
    if not path.is_file():
        raise EdgepathError(f"{path}: llama.cpp's {name} is missing; run scripts/setup.sh")
    return path


def _run_tool(name: str, *args: str | os.PathLike) -> None:
    done = subprocess.run([str(tool(name)), *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise EdgepathError(f"{name} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def importance_matrix(f16: str | os.PathLike, text: str | os.PathLike, out: str | os.PathLike, context: int,
                      threads: int) -> None:
    """llama.cpp's importance matrix of ``f16`` over the text file ``text`` (chunks of
    ``context`` tokens, special tokens such as a chat template's parsed as such) at ``out``."""
    _run_tool("llama-imatrix", "-m", f16, "-f", text, "-o", out, "-c", str(context), "-t", str(threads),
              "--parse-special", "--no-ppl")


def quantize_with_imatrix(f16: str | os.PathLike, out: str | os.PathLike, ftype: str, imatrix: str | os.PathLike,
                          threads: int) -> None:
    """Quantize ``f16`` to ``ftype`` at ``out`` weighting each weight's rounding error by
    ``imatrix`` (``importance_matrix``), as llama.cpp's own tool does."""
    _run_tool("llama-quantize", "--imatrix", imatrix, f16, out, ftype, str(threads))


def _quiet_logs() -> None:
    """llama.cpp logs every tensor at load; keep warnings and errors only."""
    import llama_cpp

    @llama_cpp.llama_log_callback
    def log(level, text, user_data):
        if level in (_LOG_WARN, _LOG_ERROR):
            sys.stderr.write(text.decode(errors="replace"))

    _quiet_logs.callback = log  # the C side keeps only the pointer
    llama_cpp.llama_log_set(log, ctypes.c_void_p())


def quantize_gguf(f16: str | os.PathLike, out: str | os.PathLike, ftype: str, threads: int) -> None:
    """Quantize the F16 GGUF ``f16`` to ``ftype`` (a key of ``FTYPES``) at ``out``."""
    import llama_cpp

    _quiet_logs()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise EdgepathError(f"llama_model_quantize({f16} -> {ftype}) returned {rc}")


def system_info() -> str:
    """What this llama.cpp build runs on (its ISA features), as llama.cpp prints it."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


class LlamaCpp:
    """One GGUF model in one context (``n_ctx`` tokens, batches of up to ``n_batch``),
    on ``threads`` threads for decode and prefill alike."""

    def __init__(self, gguf: str | os.PathLike, threads: int, n_ctx: int = 1024, n_batch: int = 512) -> None:
        import llama_cpp

        self._lib = llama_cpp
        _quiet_logs()
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise EdgepathError(f"{gguf}: llama.cpp could not load it (not a GGUF, truncated, or an "
                                f"architecture this llama.cpp does not know)")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, n_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise EdgepathError(f"{gguf}: llama.cpp could not create a context of {n_ctx} tokens")
        self.n_batch = n_batch
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        self._lib.llama_batch_free(self.batch)
        self._lib.llama_free(self.ctx)
        self._lib.llama_model_free(self.model)

    def info(self) -> dict[str, Any]:
        desc = ctypes.create_string_buffer(256)
        self._lib.llama_model_desc(self.model, desc, len(desc))
        size, params = self._lib.llama_model_size(self.model), self._lib.llama_model_n_params(self.model)
        return {"desc": desc.value.decode(), "tensor_bytes": size, "parameters": params,
                "bits_per_weight": round(size * 8 / params, 3), "system_info": system_info()}

    def _reset(self) -> None:
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self.ctx), True)

    def _decode(self, tokens: Sequence[int], start: int, all_logits: bool) -> None:
        """Evaluate ``tokens`` at positions ``start``... in batches; logits for every
        position of each batch (``all_logits``) or for the last token only."""
        for offset in range(0, len(tokens), self.n_batch):
            chunk = tokens[offset:offset + self.n_batch]
            b = self.batch
            b.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = token, start + offset + i, 1
                b.seq_id[i][0] = 0
                b.logits[i] = all_logits or (offset + i == len(tokens) - 1)
            rc = self._lib.llama_decode(self.ctx, b)
            if rc != 0:
                raise EdgepathError(f"llama_decode returned {rc} at position {start + offset}")

    def _logits(self, i: int):
        import numpy as np

        return np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))

    def _generate(self, prompt: Sequence[int], new_tokens: int) -> tuple[list[int], float]:
        """Greedy tokens after ``prompt``, and the seconds the ``new_tokens`` decode
        steps took (prefill excluded)."""
        self._reset()
        self._decode(prompt, 0, all_logits=False)
        out = [int(self._logits(-1).argmax())]
        started = time.perf_counter()
        for step in range(new_tokens - 1):
            self._decode([out[-1]], len(prompt) + step, all_logits=False)
            out.append(int(self._logits(-1).argmax()))
        return out, time.perf_counter() - started

    def decode_seconds_per_token(self, prompt: Sequence[int], new_tokens: int) -> float:
        _, seconds = self._generate(prompt, new_tokens + 1)
        return seconds / new_tokens

    def prefill_seconds(self, prompt: Sequence[int]) -> float:
        self._reset()
        started = time.perf_counter()
        self._decode(prompt, 0, all_logits=False)
        return time.perf_counter() - started

    def greedy(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
        return [self._generate(p, new_tokens)[0] for p in prompts]

    def score(self, sequences: Sequence[Sequence[int]]) -> dict[str, list]:
        """Per sequence, the negative log-likelihood of each token after the first and
        the top-1 prediction at each position before the last (teacher-forced)."""
        import numpy as np

        nll, top1 = [], []
        for seq in sequences:
            self._reset()
            seq_nll, seq_top1 = [], []
            for offset in range(0, len(seq) - 1, self.n_batch):
                chunk = seq[offset:offset + self.n_batch]
                self._decode(chunk, offset, all_logits=True)
                for i in range(len(chunk)):
                    if offset + i + 1 >= len(seq):
                        break
                    logits = self._logits(i).astype(np.float64)
                    top = logits.max()
                    log_z = top + np.log(np.exp(logits - top).sum())
                    seq_nll.append(float(log_z - logits[seq[offset + i + 1]]))
                    seq_top1.append(int(logits.argmax()))
            nll.append(seq_nll)
            top1.append(seq_top1)
        return {"nll": nll, "top1": top1}
