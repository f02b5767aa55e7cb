"""GPTQ "v1" symmetric int4: the checkpoint layout vLLM's CPU GPTQ kernels read.

For one linear layer ``W`` of shape ``[N out, K in]`` and group size ``g``
(``K % g == 0``, ``K % 8 == 0``, ``N % 8 == 0``)::

    qweight  int32 [K/8, N]   codes c in 0..15; row 8r+i of the code matrix
                              [K, N] sits in nibble i of qweight[r] (bits 4i..4i+3,
                              low nibble first)
    qzeros   int32 [K/g, N/8] zero - 1 = 7 in every nibble (the v1 convention;
                              vLLM's CPU path ignores it for sym, other loaders
                              add 1 back), column 8c+i in nibble i
    scales   fp16  [K/g, N]   per (group, output channel)
    g_idx    int32 [K]        k // g (no act-order: it would take W4A8 away)

    dequantized W[n, k] = (c[k, n] - 8) * scales[k // g, n]

The packed tensors are little-endian int32 bit patterns; a nibble 8+ in the top
position makes the int32 negative, which is how every GPTQ loader reads it.
"""

from __future__ import annotations

import dataclasses

import torch

BITS = 4
ZERO = 8
"""The fixed zero point: the W4A8 kernel computes (code - 8) * scale."""
STORED_ZERO = ZERO - 1
"""What v1 files store in ``qzeros``."""
CODE_MAX = 2**BITS - 1
PACK = 32 // BITS
_SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] ints in 0..15 -> int32 [R/8, C], rows 8r..8r+7 in nibbles 0..7."""
    r, c = codes.shape
    assert r % PACK == 0, f"{r} rows do not pack into int32 words of {PACK} nibbles"
    grouped = codes.to(torch.int64).reshape(r // PACK, PACK, c)
    words = (grouped << _SHIFTS.to(torch.int64).view(1, PACK, 1)).sum(dim=1)
    # two's complement: a word above 2**31 - 1 is stored as the negative int32 it is
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_pack_rows``: int32 [R/8, C] -> int32 [R, C] codes."""
    r8, c = words.shape
    nibbles = (words.unsqueeze(1) >> _SHIFTS.view(1, PACK, 1)) & CODE_MAX
    return nibbles.reshape(r8 * PACK, c)


@dataclasses.dataclass
class GptqV1Int4:
    """One layer in GPTQ v1 symmetric int4 form; tensors as in the module docstring."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.g_idx.numel() // self.scales.shape[0]

    @classmethod
    def pack(cls, codes: torch.Tensor, scales: torch.Tensor) -> "GptqV1Int4":
        """``codes``: [N, K] ints in 0..15 (the ``W`` orientation); ``scales``: [N, K/g]
        with values exactly representable in fp16 (the quantizer picks them so)."""
        n, k = codes.shape
        groups = scales.shape[1]
        assert scales.shape[0] == n and k % groups == 0, f"scales {tuple(scales.shape)} do not fit codes {tuple(codes.shape)}"
        assert n % PACK == 0 and k % PACK == 0, f"[{n}, {k}] is not a multiple of {PACK} both ways"
        assert int(codes.min()) >= 0 and int(codes.max()) <= CODE_MAX, "codes outside 0..15"
        scales16 = scales.to(torch.float16)
        assert torch.equal(scales16.to(scales.dtype), scales), "scales are not exactly fp16"
        g = k // groups
        return cls(
            qweight=_pack_rows(codes.t().contiguous()),
            qzeros=_pack_rows(torch.full((n, groups), STORED_ZERO, dtype=torch.int32)).t().contiguous(),
            scales=scales16.t().contiguous(),
            g_idx=torch.arange(k, dtype=torch.int32) // g,
        )

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """State-dict entries for the layer ``prefix`` (e.g. ``model.layers.0.mlp.up_proj``)."""
        return {f"{prefix}.{name}": getattr(self, name) for name in ("qweight", "qzeros", "scales", "g_idx")}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "GptqV1Int4":
        layer = cls(**{name: tensors[f"{prefix}.{name}"] for name in ("qweight", "qzeros", "scales", "g_idx")})
        k, n = layer.qweight.shape[0] * PACK, layer.qweight.shape[1]
        if layer.g_idx.numel() != k or layer.scales.shape[1] != n or layer.qzeros.shape != (layer.scales.shape[0], n // PACK):
            raise ValueError(f"{prefix}: GPTQ tensors of inconsistent shapes")
        if not torch.equal(layer.g_idx, torch.arange(k, dtype=torch.int32) // layer.group_size):
            raise ValueError(f"{prefix}: g_idx is not trivial (act-order checkpoints are not supported)")
        return layer

    def codes(self) -> torch.Tensor:
        """[N, K] codes in 0..15."""
        return _unpack_rows(self.qweight).t()

    def zeros(self) -> torch.Tensor:
        """[N, K/g] zero points as a loader reads them (stored value + 1)."""
        return _unpack_rows(self.qzeros.t().contiguous()) + 1

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] weights, (code - zero) * scale, computed in fp32."""
        g = self.group_size
        codes = self.codes().to(torch.float32)
        zeros = self.zeros().to(torch.float32).repeat_interleave(g, dim=1)
        scales = self.scales.t().to(torch.float32).repeat_interleave(g, dim=1)
        return ((codes - zeros) * scales).to(dtype)
