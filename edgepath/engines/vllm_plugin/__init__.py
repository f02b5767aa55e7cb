"""edgepath's vLLM plugin: the cpu_int4 quantization method and the CPU runtime patches.

vLLM calls ``register`` (entry point ``vllm.general_plugins``: ``edgepath``) in
every process that builds an engine, the engine core included, before it
reads a model. Each patch is idempotent, can be switched off by its
environment variable, and reports itself through ``status()`` (what
patch-verify records). What was done is written once per process to stderr,
one line per patch (vLLM configures its own log handlers only after plugins
have loaded, so its logger would drop them):

==================  ============================  =========  ==========================================
patch               variable                      default    does
==================  ============================  =========  ==========================================
``cpu_int4``        ``EDGEPATH_CPU_INT4``         on         quantization method ``cpu_int4`` (tinygemm)
``compile_cache``   ``EDGEPATH_COMPILE_CACHE``    on         AOT compile cache loads on the CPU
``fused_norms``     ``EDGEPATH_FUSED_CPU_NORMS``  off        vLLM's C++ RMSNorm kernels on the CPU
``head_gate``       ``EDGEPATH_HEAD_GATE``        off        per-head gate projections, opaque eager op
``w4a8_vnni``       ``EDGEPATH_W4A8_VNNI``        on         vLLM's W4A8 GPTQ kernel on AVX512-VNNI
==================  ============================  =========  ==========================================

A variable set to ``0`` turns its patch off, ``1`` on. State per patch:
``applied``, ``not needed`` (vLLM no longer has the problem), ``not
applicable`` (nothing here for it to act on) or ``off`` (switched off).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

# Default of each switch, from benchmarks/results/plugin.md. fused_norms: off, no
# measurable end-to-end gain (decode +3 %, prefill -2 %, inside the noise). head_gate: off; on this team's AVX2 hosts vLLM's GEMM
# for these shapes is F.linear, which beat the multiply-and-sum 2.7-21x at 1-64 rows
# in isolation; the reported gain was against oneDNN on an AMX Xeon. w4a8_vnni: on; it acts only
# where W4A8 is asked for, and there it decoded 1.04x tinygemm W4A16 at batch 1 and prefilled 1.9x
# (Zen 4, SmolLM2-135M, 2 cores, benchmarks/results/w4a8_vnni.md).
SWITCHES = {
    "cpu_int4": ("EDGEPATH_CPU_INT4", True),
    "compile_cache": ("EDGEPATH_COMPILE_CACHE", True),
    "fused_norms": ("EDGEPATH_FUSED_CPU_NORMS", False),
    "head_gate": ("EDGEPATH_HEAD_GATE", False),
    "w4a8_vnni": ("EDGEPATH_W4A8_VNNI", True),
}
_status: dict[str, dict[str, str]] = {}


def enabled(patch: str) -> bool:
    variable, default = SWITCHES[patch]
    value = os.environ.get(variable, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{variable}={value!r}: set it to 0 (off) or 1 (on)")
    return default if value == "" else value == "1"


def _install_cpu_int4() -> tuple[str, str]:
    from . import cpu_int4

    return "applied", f"quantization method cpu_int4 registered ({cpu_int4.KERNEL_OP}, tinygemm)"


def _installer(patch: str):
    if patch == "cpu_int4":
        return _install_cpu_int4
    return importlib.import_module(f"{__name__}.{patch}").install


def register() -> None:
    """vLLM's plugin hook. Safe to call any number of times in a process."""
    for patch, (variable, _) in SWITCHES.items():
        if patch in _status:
            continue
        if enabled(patch):
            state, detail = _installer(patch)()
        else:
            state, detail = "off", f"{variable}=0" if os.environ.get(variable) else f"off by default ({variable}=1 turns it on)"
        _status[patch] = {"state": state, "detail": detail}
        print(f"edgepath plugin: {patch} {state}: {detail}", file=sys.stderr, flush=True)


def status() -> dict[str, Any]:
    """Per patch its state and detail, with what it has done in this process so far."""
    from . import compile_cache, head_gate, w4a8_vnni

    result = {patch: dict(s) for patch, s in _status.items()}
    if "compile_cache" in result:
        result["compile_cache"]["loads"] = compile_cache.counts()
    if "head_gate" in result:
        result["head_gate"]["layers"] = head_gate.gated_layers()
    if "w4a8_vnni" in result:
        result["w4a8_vnni"]["layers"] = w4a8_vnni.layers()
    return result
