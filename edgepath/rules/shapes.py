"""Which layers a 4-bit path quantizes, and the group size their shapes allow.

Policy only (names and shapes in, a decision and its reason out); the numeric
packing lives with the quantizer.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from ..core.errors import EdgepathError

# Decoder-block projections (q/k/v/o, gate/up/down). Embeddings, norms and the
# output head are outside ``.layers.N.`` and are not in this set.
_BLOCK_LINEAR = re.compile(r"(^|\.)layers\.\d+\..+\.weight$")


def block_linears(tensors: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, int]]:
    """``{name: (out, in)}`` of the 2-D weights inside decoder blocks."""
    return {
        name: (int(shape[0]), int(shape[1]))
        for name, shape in sorted(tensors.items())
        if len(shape) == 2 and _BLOCK_LINEAR.search(name)
    }


@dataclasses.dataclass(frozen=True)
class KernelShapeRule:
    """Shapes a 4-bit CPU kernel accepts. ``group_sizes`` is in order of preference,
    and ``preference`` says why, in a clause."""

    kernel: str
    group_sizes: tuple[int, ...]
    in_multiple: int
    out_multiple: int
    preference: str = "larger groups store fewer scales, and decode reads every scale once per token"

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        if in_features % self.in_multiple or out_features % self.out_multiple:
            raise EdgepathError(
                f"layer {name} has shape [out {out_features}, in {in_features}]; {self.kernel} "
                f"needs the input size a multiple of {self.in_multiple} and the output size a "
                f"multiple of {self.out_multiple}"
            )

    def choose_group_size(self, linears: Mapping[str, tuple[int, int]]) -> tuple[int, str]:
        """The first preferred group size that divides every layer's input size,
        with the reason in a sentence. Refuses, naming the layer, when none does."""
        if not linears:
            raise EdgepathError(f"the model has no decoder-block linear layers for {self.kernel} to quantize")
        for name, (out_features, in_features) in linears.items():
            self.check_layer(name, out_features, in_features)
        in_sizes = sorted({k for _, k in linears.values()})
        for g in self.group_sizes:
            blocker = next((n for n, (_, k) in linears.items() if k % g), None)
            if blocker is None:
                skipped = [str(s) for s in self.group_sizes[: self.group_sizes.index(g)]]
                verb = "does" if len(skipped) == 1 else "do"
                why_not = f" ({', '.join(skipped)} {verb} not divide every input size)" if skipped else ""
                which = f" is the first of {list(self.group_sizes)} that" if len(self.group_sizes) > 1 else ""
                return g, (
                    f"group size {g} ({self.kernel}){which} divides every quantized input size "
                    f"{in_sizes}{why_not}; {self.preference}"
                )
        name = next(iter(linears))
        raise EdgepathError(
            f"no group size in {list(self.group_sizes)} divides every input size {in_sizes} "
            f"(e.g. layer {name}, input size {linears[name][1]}): {self.kernel} cannot run this model"
        )


# vLLM 0.32.0 CPU GPTQ (int4_scaled_mm_cpu / cpu_gemm_wna16): sizes multiples of
# 32 and an even group. Group 32 only, though 64 and 128 run too: the W4A8 build's
# symmetric grid at group 64 lost 1.65x llama.cpp Q4_K_M's held-out perplexity, at 32
# 1.13x (SmolLM2-135M). On a larger model, where decode reads the weights, the 0.31 more
# bits per weight cost up to 7 % of decode (unmeasured).
GPTQ_CPU = KernelShapeRule(
    "vLLM's CPU int4 GPTQ kernel", (32,), in_multiple=32, out_multiple=32,
    preference=("smaller groups lose less at 4 bits: on SmolLM2-135M the W4A8 build's GPTQ lost 6.60 % mean "
                "held-out perplexity over bf16 at group 32 against 9.60 % at 64, for 0.31 more bits per weight "
                "(benchmarks/results/calibration.md)"))
# aten._weight_int4pack_mm_for_cpu (tinygemm): groups 32..256, N a multiple of 16.
TINYGEMM_CPU = KernelShapeRule("tinygemm (_weight_int4pack_mm_for_cpu)", (128, 64, 32), in_multiple=32, out_multiple=16)
# llama.cpp's Q4_0 block (ggml's QK4_0): 32 weights along a row; any row count.
GGUF_Q4_0 = KernelShapeRule("llama.cpp's Q4_0 kernels", (32,), in_multiple=32, out_multiple=1,
                            preference="Q4_0's block is 32 weights")
