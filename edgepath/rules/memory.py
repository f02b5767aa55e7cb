"""Whether a build fits its device: the resident memory it needs against what the device has.

A build needs, resident at once:

- its **weights**: before the build exists, counted from the model's tensor shapes and
  how the path stores each kind of tensor (``WeightPathSpec.bits_per_weight`` for the
  block linears, ``WeightPathSpec.storage`` for the rest); once built, the artifact's
  own bytes (the quantize and export records);
- its **KV cache**: the keys and values of every layer for the target's ``context``
  tokens, in the engine's cache dtype (``KV_CACHE_BYTES``). vLLM on a CPU reserves
  ``VLLM_CPU_KV_SPACE_GIB`` whatever the context, and more where the context needs it;
- its **engine's own memory** beside those (interpreter, libraries, compiled graphs,
  compute buffers), measured where the engine runs here (``runtime_memory``). Where it
  was not measured (ExecuTorch's runtime on a phone, vLLM on a GPU) the need counts none
  and says so.

A device has its RAM (``ram_total_bytes``), or for a GPU build its GPU's memory. The
selector compares the two (``rules.select``); nothing here is reserved for the
device's operating system, so a build that needs most of a device's memory shows it in
the share the manifest prints.

Plain Python: the figures come from the records in ``measured/``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.errors import EdgepathError
from . import measurements
from .coverage import DeviceClass, device_class
from .profile import HardwareProfile
from .shapes import block_linears
from .weight_paths import Engine, WeightPathSpec

GIB = 2**30
# The context a target's memory is counted at unless its params say otherwise: the
# context `edgepath serve` gives each sequence by default, so a build that fits serves.
DEFAULT_CONTEXT = 2048
# vllm-cpu preallocates its KV cache as VLLM_CPU_KVCACHE_SPACE GiB, which its adapter
# (engines.vllm_cpu.ENGINE_ENV) sets from this: the engine's own default of 4 GiB would
# be most of a small device's memory, and one GiB holds Qwen2.5-1.5B's cache (two KV
# heads) for 2048 tokens many times over.
VLLM_CPU_KV_SPACE_GIB = 1
# Bytes per cached key or value element: llama.cpp caches F16 by default, vLLM the
# model's dtype (bf16/fp16), ExecuTorch's custom KV cache fp32 (phone.xnnpack).
KV_CACHE_BYTES = {Engine.LLAMA_CPP: 2, Engine.VLLM: 2, Engine.EXECUTORCH: 4}
# The engine runs whose memory stands for each engine's own (``runtime_memory``).
_RUNTIME_RUN = {Engine.VLLM: ("engine_auto.json", "vllm bf16"), Engine.LLAMA_CPP: ("engine_auto.json", "llama.cpp F16")}
_KV_PROJECTION = re.compile(r"\.(k_proj|v_proj)\.weight$")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What of a model its memory depends on: every tensor's shape, and the attention's
    cache geometry."""

    tensors: Mapping[str, Sequence[int]]
    layers: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ModelShape:
        """From a model record (``edgepath model``): its tensors and Hugging Face config."""
        config = record["config"]
        try:
            heads = int(config["num_attention_heads"])
            head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
            return cls({n: t["shape"] for n, t in record["tensors"].items()}, int(config["num_hidden_layers"]),
                       int(config.get("num_key_value_heads") or heads), head_dim,
                       bool(config.get("tie_word_embeddings", False)))
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise EdgepathError(f"the model record's config lacks the attention's shape ({e!r}): "
                                f"num_hidden_layers, num_attention_heads and hidden_size") from None

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


def weights_bytes(spec: WeightPathSpec, group: int | None, model: ModelShape) -> int:
    """The bytes of ``spec``'s artifact for ``model`` at group size ``group``: the block
    linears at the path's bits per weight (its key and value projections at
    ``storage.kv`` where set), the embedding, the head and the rest at ``storage``'s."""
    store, linears = spec.storage, block_linears(model.tensors)
    bits = 0.0
    for name, shape in model.tensors.items():
        count = math.prod(shape)
        if name in linears:
            bits += count * (store.kv if store.kv is not None and _KV_PROJECTION.search(name)
                             else spec.bits_per_weight(group))
        elif name.endswith("embed_tokens.weight"):
            bits += count * (store.embedding + (store.head if model.tied and store.head_apart else 0))
        elif name == "lm_head.weight":
            bits += count * store.head
        else:
            bits += count * store.other
    return math.ceil(bits / 8)


@dataclasses.dataclass(frozen=True)
class RuntimeMemory:
    """An engine's own resident memory beside a build's weights and KV cache."""

    bytes: int
    measured: str


def runtime_memory(engine: Engine, on_gpu: bool = False) -> RuntimeMemory | None:
    """The engine's own memory as measured here (``_RUNTIME_RUN``): the peak anonymous
    resident memory of its process in the benchmark stage, less what of it the weights
    and KV cache were. vLLM loads its weights into anonymous memory and preallocates its
    KV space, so both come off; llama.cpp maps its weights from the file, so its
    anonymous peak is its own (with its 1024-token KV cache in it: a little over). None
    where the engine was not measured here: ExecuTorch's runtime, or any engine on a GPU."""
    if on_gpu or engine not in _RUNTIME_RUN:
        return None
    record, arm_name = _RUNTIME_RUN[engine]
    arm = measurements.arm(record, arm_name)
    peak, what = arm["memory"]["rss_anon_peak_bytes"], "its weights mapped from the file"
    if engine is Engine.VLLM:
        peak -= arm["bytes_per_token"] + VLLM_CPU_KV_SPACE_GIB * GIB
        what = "less its weights and KV space"
    return RuntimeMemory(peak, f"{arm_name}'s peak anonymous memory, {what}; {measurements.where(record)}")


@dataclasses.dataclass(frozen=True)
class MemoryNeed:
    """A build's resident memory need at ``context`` tokens (module docstring)."""

    weights: int
    kv_cache: int
    runtime: int
    context: int
    runtime_measured: str | None
    """What measured ``runtime``; None where it was not measured (it is then 0)."""
    weights_from: str
    """``estimated from the model's shapes`` or the artifact it was read from."""

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.runtime

    def __str__(self) -> str:
        runtime = f"runtime {_gib(self.runtime)}" if self.runtime_measured else "runtime not measured"
        return (f"{_gib(self.total)} (weights {_gib(self.weights)}, KV cache {_gib(self.kv_cache)} at "
                f"{self.context} tokens, {runtime})")

    def to_dict(self) -> dict[str, Any]:
        return {"need_bytes": self.total, "weights_bytes": self.weights, "kv_cache_bytes": self.kv_cache,
                "runtime_bytes": self.runtime, "context": self.context, "runtime_measured": self.runtime_measured,
                "weights_from": self.weights_from}


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What a device has for a build: its RAM, or its GPU's memory."""

    bytes: int
    what: str

    def __str__(self) -> str:
        return f"the device's {_gib(self.bytes)} of {self.what}"


def capacity(profile: HardwareProfile) -> Capacity:
    if device_class(profile) is DeviceClass.GPU and profile.gpu_mem_bytes:
        return Capacity(profile.gpu_mem_bytes, "GPU memory")
    return Capacity(profile.ram_total_bytes, "RAM")


def need(spec: WeightPathSpec, group: int | None, model: ModelShape, context: int,
         profile: HardwareProfile) -> MemoryNeed:
    """``spec``'s need on ``profile``'s device at ``context`` tokens, its weights estimated
    from the model's shapes (``with_built_weights`` counts a built artifact's)."""
    if context < 1:
        raise EdgepathError(f"a context of {context} tokens: it must be at least 1")
    on_gpu = device_class(profile) is DeviceClass.GPU
    kv = context * model.kv_bytes_per_token(KV_CACHE_BYTES[spec.engine])
    if spec.engine is Engine.VLLM and not on_gpu:
        kv = max(kv, VLLM_CPU_KV_SPACE_GIB * GIB)
    runtime = runtime_memory(spec.engine, on_gpu)
    return MemoryNeed(weights_bytes(spec, group, model), kv, runtime.bytes if runtime else 0, context,
                      runtime.measured if runtime else None, "estimated from the model's shapes")


def record(found: MemoryNeed, have: Capacity) -> dict[str, Any]:
    """The selection record's ``path.memory``: the need, what the device has, and whether it fits."""
    return {**found.to_dict(), "have_bytes": have.bytes, "have": have.what, "fits": found.total <= have.bytes}


def with_built_weights(found: Mapping[str, Any], weights: int, weights_from: str) -> dict[str, Any]:
    """A ``record`` whose weights were estimated, with the built artifact's ``weights``
    bytes in their place (``weights_from`` names the files)."""
    total = found["need_bytes"] - found["weights_bytes"] + weights
    return {**found, "weights_bytes": weights, "need_bytes": total, "fits": total <= found["have_bytes"],
            "weights_from": weights_from}


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
