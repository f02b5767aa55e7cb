"""cpu_int4: edgepath's asymmetric 4-bit checkpoint for PyTorch's CPU tinygemm kernel.

The ``w4a16-tinygemm`` path writes it (``edgepath quantize``) and edgepath's
vLLM plugin reads it (``quantization="cpu_int4"``,
``edgepath.engines.vllm_plugin.cpu_int4``). For one linear layer ``W`` of shape
``[N out, K in]`` and group size ``g`` (``K % g == 0``, ``K`` even)::

    qweight  uint8 [N, K/2]   codes c in 0..15, row-major like W: the code of
                              W[n, 2j] in the low nibble (bits 0-3) of
                              qweight[n, j], W[n, 2j+1] in the high nibble
    scales   bf16  [N, K/g]   per (output channel, group of g input columns)
    offsets  bf16  [N, K/g]   same indexing

    dequantized W[n, k] = (c[n, k] - 8) * scales[n, k // g] + offsets[n, k // g]

A group's grid is min/max: ``scale = (max - min) / 15`` and ``offset = min + 8 *
scale``, so codes 0 and 15 land on the group's extremes (up to bf16 rounding).
The ``- 8`` and the offset are tinygemm's own convention
(``aten._weight_int4pack_mm_for_cpu`` computes ``(c - 8) * scale + zero``), so
the kernel reads these values as they are. On disk the codes are in this plain
nibble order, not in tinygemm's CPU-specific packed tiles
(``aten._convert_weight_to_int4pack_for_cpu``), which the plugin builds at load:
the file stays readable by anything that knows this docstring.

``config.json`` carries ``quantization_config``: ``quant_method: cpu_int4``,
``bits: 4``, ``group_size``, ``format_version`` (``FORMAT_VERSION``) and
``lm_head`` (whether the output head is stored this way).
"""

from __future__ import annotations

import dataclasses

import torch

from ..rules.shapes import TINYGEMM_CPU

QUANT_METHOD = "cpu_int4"
FORMAT_VERSION = 1
BITS = 4
MID = 8
"""tinygemm's fixed code midpoint: dequantized = (code - 8) * scale + offset."""
CODE_MAX = 2**BITS - 1
TENSOR_NAMES = ("qweight", "scales", "offsets")
GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes ``_weight_int4pack_mm_for_cpu`` accepts."""
N_MULTIPLE = TINYGEMM_CPU.out_multiple
"""tinygemm packs output channels in tiles of 16."""


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] ints in 0..15 -> uint8 [N, K/2], column 2j low nibble, 2j+1 high."""
    n, k = codes.shape
    assert k % 2 == 0, f"K={k} is odd: two codes share a byte"
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 [N, K/2] -> int32 [N, K]."""
    n, half = qweight.shape
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(n, 2 * half).to(torch.int32)


@dataclasses.dataclass
class CpuInt4:
    """One layer in cpu_int4 form; tensors as in the module docstring."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor

    @property
    def group_size(self) -> int:
        return 2 * self.qweight.shape[1] // self.scales.shape[1]

    @classmethod
    def pack(cls, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> "CpuInt4":
        """``codes``: [N, K] ints in 0..15; ``scales``, ``offsets``: [N, K/g] with values
        exactly representable in bf16 (the quantizer picks them so)."""
        n, k = codes.shape
        groups = scales.shape[1]
        assert scales.shape == offsets.shape == (n, groups) and k % groups == 0, \
            f"scales {tuple(scales.shape)} / offsets {tuple(offsets.shape)} do not fit codes {tuple(codes.shape)}"
        assert int(codes.min()) >= 0 and int(codes.max()) <= CODE_MAX, "codes outside 0..15"
        for name, t in (("scales", scales), ("offsets", offsets)):
            assert torch.equal(t.to(torch.bfloat16).to(t.dtype), t), f"{name} are not exactly bf16"
        return cls(qweight=pack_codes(codes), scales=scales.to(torch.bfloat16).contiguous(),
                   offsets=offsets.to(torch.bfloat16).contiguous())

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """State-dict entries for the layer ``prefix`` (e.g. ``model.layers.0.mlp.up_proj``)."""
        return {f"{prefix}.{name}": getattr(self, name) for name in TENSOR_NAMES}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "CpuInt4":
        missing = [n for n in TENSOR_NAMES if f"{prefix}.{n}" not in tensors]
        if missing:
            raise ValueError(f"{prefix}: cpu_int4 tensors {missing} are missing")
        layer = cls(**{name: tensors[f"{prefix}.{name}"] for name in TENSOR_NAMES})
        layer.check(prefix)
        return layer

    def check(self, prefix: str) -> None:
        """Raise ValueError naming ``prefix`` unless dtypes and shapes are this format's."""
        want = {"qweight": torch.uint8, "scales": torch.bfloat16, "offsets": torch.bfloat16}
        for name, dtype in want.items():
            t = getattr(self, name)
            if t.dtype != dtype or t.dim() != 2:
                raise ValueError(f"{prefix}.{name}: {t.dtype} {tuple(t.shape)}, cpu_int4 stores 2-D {dtype}")
        n, half = self.qweight.shape
        if self.scales.shape != self.offsets.shape or self.scales.shape[0] != n or (2 * half) % self.scales.shape[1]:
            raise ValueError(f"{prefix}: qweight {tuple(self.qweight.shape)}, scales {tuple(self.scales.shape)} and "
                             f"offsets {tuple(self.offsets.shape)} are not one cpu_int4 layer")

    def codes(self) -> torch.Tensor:
        """[N, K] codes in 0..15."""
        return unpack_codes(self.qweight)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] weights, (code - 8) * scale + offset, computed in fp32."""
        g = self.group_size
        scales = self.scales.to(torch.float32).repeat_interleave(g, dim=1)
        offsets = self.offsets.to(torch.float32).repeat_interleave(g, dim=1)
        return ((self.codes().to(torch.float32) - MID) * scales + offsets).to(dtype)

    def tinygemm_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed weight, scales-and-zeros) as ``aten._weight_int4pack_mm_for_cpu`` takes
        them: uint8 [N, K/2] in its CPU tile order, and bf16 [K/g, N, 2]."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes(), 1)
        scale_and_zero = torch.stack([self.scales.t(), self.offsets.t()], dim=-1).contiguous()
        return packed, scale_and_zero
