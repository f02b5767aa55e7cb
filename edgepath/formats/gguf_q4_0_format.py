"""GGUF Q4_0: llama.cpp's plain 4-bit block, holding the symmetric GPTQ grid at group 32.

For one weight ``W`` of shape ``[N out, K in]`` (ggml's ``ne = [K, N]``: a row is an
output channel; ``K % 32 == 0``), each row is ``K / 32`` blocks of 18 bytes::

    d    fp16, little-endian   the block's scale
    qs   uint8 [16]            code c[j] in the low nibble of qs[j] and c[j + 16] in its
                               high nibble, j < 16; codes 0..15

    W[n, 32 b + j] = (c[j] - 8) * d

That is the symmetric grid of ``quant.gptq`` at group 32: zero at 8, one scale per
group, scales exact in fp16. llama.cpp's own quantizer sets ``d`` to the block's
value of largest magnitude over -8 and rounds to nearest; a GPTQ block keeps the
scale its search chose and GPTQ's codes, so the file holds GPTQ's weights bit for bit.

``from_values`` recovers a block's scale and codes from its dequantized values and
refuses a block that is not exactly on such a grid: the proof that nothing was
rounded on the way (a weight off the grid would be re-rounded by any packer).
"""

from __future__ import annotations

import dataclasses

import numpy as np

BLOCK = 32
"""Weights per block (ggml's ``QK4_0``)."""
BLOCK_BYTES = 2 + BLOCK // 2
ZERO = 8


@dataclasses.dataclass
class GgufQ4_0:
    """One weight in Q4_0 blocks: ``blocks`` is uint8 ``[N, K / 32 * 18]``, the bytes
    llama.cpp reads for the tensor (the layout of the module docstring)."""

    blocks: np.ndarray

    def __post_init__(self) -> None:
        assert self.blocks.dtype == np.uint8 and self.blocks.ndim == 2, (self.blocks.dtype, self.blocks.shape)
        assert self.blocks.shape[1] % BLOCK_BYTES == 0, f"a row of {self.blocks.shape[1]} bytes is not whole blocks"

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight."""
        return self.blocks.shape[0], self.blocks.shape[1] // BLOCK_BYTES * BLOCK

    @classmethod
    def pack(cls, codes: np.ndarray, scales: np.ndarray) -> "GgufQ4_0":
        """``codes``: ints 0..15 ``[N, K]``; ``scales``: ``[N, K / 32]``, exact in fp16."""
        n, k = codes.shape
        assert k % BLOCK == 0, f"K = {k} is not a multiple of the Q4_0 block ({BLOCK})"
        assert scales.shape == (n, k // BLOCK), f"scales {scales.shape} for codes {codes.shape}"
        assert codes.min() >= 0 and codes.max() <= 15, "codes outside 0..15"
        d = scales.astype(np.float16)
        assert np.array_equal(d.astype(np.float32), scales.astype(np.float32)), "a scale is not exact in fp16"
        c = codes.astype(np.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
        qs = c[:, :, 0, :] | (c[:, :, 1, :] << np.uint8(4))
        blocks = np.concatenate([d.reshape(n, k // BLOCK, 1).view(np.uint8), qs], axis=-1)
        return cls(np.ascontiguousarray(blocks.reshape(n, -1)))

    @classmethod
    def from_values(cls, values: np.ndarray) -> "GgufQ4_0":
        """The blocks of ``values`` ``[N, K]`` (float32), which must lie exactly on a
        symmetric 4-bit grid with one fp16 scale per 32 (``ValueError`` otherwise).
        Among the scales that reproduce a block, the largest code span is taken; any
        of them dequantizes to the same values."""
        n, k = values.shape
        assert k % BLOCK == 0, f"K = {k} is not a multiple of the Q4_0 block ({BLOCK})"
        v = values.astype(np.float32).reshape(-1, BLOCK)
        absmax = np.abs(v).max(axis=1)
        scales = np.zeros(len(v), dtype=np.float32)
        codes = np.full(v.shape, ZERO, dtype=np.int32)
        found = absmax == 0
        # the value of largest magnitude sits at code 8 - m or 8 + m for some m in 1..8
        for m in range(8, 0, -1):
            for sign in (1.0, -1.0):
                d = (sign * absmax / m).astype(np.float16).astype(np.float32)
                with np.errstate(divide="ignore", invalid="ignore"):
                    q = np.round(v / d[:, None])
                    exact = (q * d[:, None] == v) & (q >= -ZERO) & (q <= ZERO - 1)
                ok = ~found & (d != 0) & exact.all(axis=1)
                scales[ok], codes[ok] = d[ok], q[ok].astype(np.int32) + ZERO
                found |= ok
        if not found.all():
            row, block = divmod(int(np.argmin(found)), k // BLOCK)
            raise ValueError(f"{int((~found).sum())} of {len(v)} blocks are not on a 4-bit grid with an fp16 "
                             f"scale (the first: row {row}, columns {block * BLOCK}..{block * BLOCK + BLOCK - 1})")
        return cls.pack(codes.reshape(n, k), scales.reshape(n, k // BLOCK))

    def dequantize(self) -> np.ndarray:
        """float32 ``[N, K]``."""
        n, k = self.shape
        b = self.blocks.reshape(n, k // BLOCK, BLOCK_BYTES)
        d = np.ascontiguousarray(b[:, :, :2]).view(np.float16).astype(np.float32)  # [N, K/32, 1]
        qs = b[:, :, 2:]
        c = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1).astype(np.float32)
        return ((c - ZERO) * d).reshape(n, k)
