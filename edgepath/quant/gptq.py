"""GPTQ on a 4-bit grid: symmetric with a per-group scale search, or asymmetric min/max.

Lifecycle, per linear layer ``W [N out, K in]``:

1. The caller accumulates the Hessian of the layer's output error,
   ``H = 2/n sum x x^T`` over calibration inputs ``x [K]`` (``HessianAccumulator``:
   its upper triangle, fp32 products folded into an fp64 sum).
2. ``quantize_layer`` orders the columns group-aware (groups by importance
   ``sum diag(H)``, columns within a group likewise; group membership stays
   ``k // g``, so the checkpoint keeps a trivial ``g_idx``), damps ``H`` and runs
   GPTQ's error feedback: each column is rounded, and its error, weighted by the
   inverse Hessian, is pushed onto the columns not yet quantized.
3. When the loop reaches a group, the group's grid is chosen on the
   *error-updated* weights by the layer's ``Grid``:

   - ``ScaleSearch`` (symmetric, the GPTQ checkpoint of ``w4a8-gptq``): per output
     channel, candidate scales ``f * absmax / 7.5`` are tried, each also negated
     (``signed``), and the least error kept.
   - ``MinMaxGrid`` (asymmetric, the cpu_int4 checkpoint of ``w4a16-tinygemm``):
     candidate ranges ``f * (max - min)`` about the group's midpoint, ``scale =
     range / 15`` and an offset that puts codes 0 and 15 on the range's ends;
     ``f = 1`` alone is the plain min/max grid, ``f < 1`` clips the extremes.

   The objective of both searches is the layer's output error restricted to the
   group, ``e^T H_gg e`` with ``e = w - q`` and ``H_gg`` the group's diagonal
   block of ``H`` (or plain weight MSE, for comparison). ``grid(symmetric,
   search)`` names them: the path fixes the grid, ``quantize.gptq.search`` the
   objective.

Every grid dequantizes as ``(code - 8) * scale + offset`` (offset 0 when symmetric).

``absmax / 7.5`` is GPTQ's own symmetric scale (range 2*absmax over 15 steps).
It leaves the top code level below the maximum; ratios above 1 widen it back,
which is why the output-error search reaches up to 1.10.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..formats.gptq_format import CODE_MAX, ZERO

# Smallest normal fp16: a scale below it would be stored inexactly (checkpoints
# keep fp16 scales); a group that small is all zeros in practice.
_MIN_SCALE = 2.0**-14


def representable_scales(scales: torch.Tensor) -> torch.Tensor:
    """Round scales to values exact in both bf16 (vLLM casts scales to the model
    dtype on load) and fp16 (the checkpoint's dtype), so the search scores the
    scale the kernel will use."""
    return scales.clamp(min=_MIN_SCALE).to(torch.bfloat16).to(torch.float32)


def quantize_codes(w: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Codes 0..15 of ``w [..., N, c]`` with per-channel ``scales [..., N]`` (and ``offsets``)."""
    if offsets is not None:
        w = w - offsets.unsqueeze(-1)
    return torch.clamp(torch.round(w / scales.unsqueeze(-1)) + ZERO, 0, CODE_MAX)


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
    w = (codes - ZERO) * scales.unsqueeze(-1)
    return w if offsets is None else w + offsets.unsqueeze(-1)


OBJECTIVES = ("output", "weight", "none")


def _least_error(w: torch.Tensor, h_gg: torch.Tensor, objective: str, scales: torch.Tensor,
                 offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Per channel, the index of the candidate grid (``scales [R, N]``, ``offsets``
    likewise) whose rounding of ``w [N, g]`` has the least error by ``objective``."""
    # quantize_codes then dequantize_codes, as (w - offset) - (code - 8) * scale, in place:
    # the search is most of GPTQ's time, and each pass over [R, N, g] costs memory traffic
    shifted = w.unsqueeze(0) if offsets is None else w.unsqueeze(0) - offsets.unsqueeze(-1)
    scale = scales.unsqueeze(-1)
    steps = torch.div(shifted, scale).round_().clamp_(-ZERO, CODE_MAX - ZERO)
    err = torch.addcmul(shifted, steps, scale, value=-1)
    loss = (err @ h_gg).mul_(err).sum(dim=-1) if objective == "output" else err.square_().sum(dim=-1)
    return loss.argmin(dim=0)


@dataclasses.dataclass(frozen=True)
class ScaleSearch:
    """The symmetric grid, ``scale = f * absmax / 7.5`` for the ``ratios`` f, chosen
    per channel by ``objective``: ``"output"`` (``e^T H_gg e``), ``"weight"``
    (``e^T e``) or ``"none"`` (one ratio)."""

    name: str
    objective: str
    ratios: tuple[float, ...]
    signed: bool = False
    """Also try each scale negated. The grid's codes -8..7 reach one step further below
    zero than above; a negative scale turns that side toward the group's positive
    extreme, so whichever side holds the largest magnitude can sit on code -8 (as
    llama.cpp's Q4_0 quantizer places it). Doubles the candidates."""

    def __post_init__(self) -> None:
        assert self.objective in OBJECTIVES, self.objective
        assert self.ratios and all(r > 0 for r in self.ratios), self.ratios
        assert not self.signed or self.objective != "none", "a sign is chosen by an objective"

    symmetric = True

    def choose(self, w: torch.Tensor, h_gg: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        """(scales ``[N]``, no offsets, chosen ratios ``[N]``) for the group ``w [N, g]``
        (fp32), ``h_gg [g, g]``. A ratio is the scale's magnitude over ``absmax / 7.5``;
        the scale carries the sign."""
        absmax = w.abs().amax(dim=1)
        ratios = torch.tensor(self.ratios, dtype=torch.float32).view(-1, 1)
        candidates = representable_scales(ratios * absmax.unsqueeze(0) / 7.5)  # [R, N]
        if len(self.ratios) == 1 and not self.signed:
            return candidates[0], None, ratios[0].expand(w.shape[0])
        if self.signed:
            candidates, ratios = torch.cat([candidates, -candidates]), ratios.repeat(2, 1)
        best = _least_error(w, h_gg, self.objective, candidates)
        return candidates.gather(0, best.unsqueeze(0)).squeeze(0), None, ratios.view(-1)[best]


@dataclasses.dataclass(frozen=True)
class MinMaxGrid:
    """The asymmetric grid of cpu_int4: for each ratio f, the range ``f * (max - min)``
    about the group's midpoint, ``scale = range / 15`` and ``offset = low end + 8 *
    scale``, both rounded to bf16 (the checkpoint's dtype); chosen per channel by
    ``objective`` as ``ScaleSearch`` chooses."""

    name: str = "minmax"
    objective: str = "none"
    ratios: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        assert self.objective in OBJECTIVES, self.objective
        assert self.ratios and all(0 < r <= 1 for r in self.ratios), self.ratios

    symmetric = False
    signed = False  # the offset places the range; scales stay positive

    def choose(self, w: torch.Tensor, h_gg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lo, hi = w.amin(dim=1), w.amax(dim=1)
        ratios = torch.tensor(self.ratios, dtype=torch.float32).view(-1, 1)
        half = ratios * ((hi - lo) / 2).unsqueeze(0)  # [R, N]
        # f = 1 starts exactly at the minimum; smaller f clip both ends about the midpoint
        low = torch.where(ratios == 1, lo.unsqueeze(0), (hi + lo).unsqueeze(0) / 2 - half)
        scales = representable_scales(2 * half / CODE_MAX)
        offsets = (low + ZERO * scales).to(torch.bfloat16).to(torch.float32)
        best = (_least_error(w, h_gg, self.objective, scales, offsets) if len(self.ratios) > 1
                else torch.zeros(w.shape[0], dtype=torch.long)).unsqueeze(0)
        return scales.gather(0, best).squeeze(0), offsets.gather(0, best).squeeze(0), ratios.view(-1)[best.squeeze(0)]


def _ratios(lo: float, hi: float, step: float = 0.01) -> tuple[float, ...]:
    return tuple(round(lo + i * step, 4) for i in range(round((hi - lo) / step) + 1))


# The searches the benchmark compares (benchmarks/quantize.py, benchmarks/calibration.py);
# "output-error" is the product's. Weight MSE only shrinks: widening cannot lower it the way
# it lowers output error. On the asymmetric grid min/max already reaches both extremes, so
# every search only clips.
SEARCHES = {
    True: {
        "none": ScaleSearch("none", "none", (1.0,)),
        "weight-mse": ScaleSearch("weight-mse", "weight", _ratios(0.80, 1.00)),
        # signed: 10.80 -> 9.60 % mean held-out perplexity increase (benchmarks/results/calibration.md)
        "output-error": ScaleSearch("output-error", "output", _ratios(0.80, 1.10), signed=True),
    },
    False: {
        "none": MinMaxGrid(),
        "weight-mse": MinMaxGrid("minmax-weight-mse", "weight", _ratios(0.80, 1.00)),
        "output-error": MinMaxGrid("minmax-output-error", "output", _ratios(0.80, 1.00)),
    },
}
MINMAX = SEARCHES[False]["none"]


def grid(symmetric: bool, search: str) -> "Grid":
    """The grid a path's ``symmetric``-ness and the ``search`` setting name."""
    return SEARCHES[symmetric][search]


Grid = ScaleSearch | MinMaxGrid
"""What ``quantize_layer`` asks for each group's scales (and offsets)."""


class HessianAccumulator:
    """Running ``2/n sum x x^T`` over rows of ``x [..., K]``, read as ``h`` (fp64).

    Cost, not precision, shapes it: the products are most of a calibration pass's time
    (93 s per layer of Qwen2.5-1.5B at 65k tokens). ``H`` is symmetric, so each batch
    adds only its upper triangle, in row blocks of ``BLOCK`` (half the multiply-adds;
    the lower half of each diagonal block comes free and is dropped when read). The
    products go into an fp32 sum in place, folded into the fp64 total every
    ``FOLD_ROWS`` rows: a running fp32 sum over a whole pass made Cholesky fail on
    real activations, and 16k rows of fp32 keep the relative error near 1e-7 of
    ``sqrt(H_ii H_jj)``, far below GPTQ's damping (1 % of the mean diagonal).
    ``2/n`` is applied once, when read."""

    BLOCK = 256
    FOLD_ROWS = 16384

    def __init__(self, in_features: int) -> None:
        self._total = torch.zeros(in_features, in_features, dtype=torch.float64)
        self._partial = torch.zeros(in_features, in_features, dtype=torch.float32)
        self._partial_rows = 0
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        k = x.shape[1]
        for start in range(0, k, self.BLOCK):
            stop = min(start + self.BLOCK, k)
            self._partial[start:stop, start:].addmm_(x[:, start:stop].t(), x[:, start:])
        self.rows += x.shape[0]
        self._partial_rows += x.shape[0]
        if self._partial_rows >= self.FOLD_ROWS:
            self._fold()

    def _fold(self) -> None:
        self._total += self._partial
        self._partial.zero_()
        self._partial_rows = 0

    @property
    def h(self) -> torch.Tensor:
        """``2/n sum x x^T`` so far (fp64, symmetric); zeros before any row."""
        self._fold()
        upper = self._total.triu()
        return (upper + upper.triu(1).t()) * (2.0 / max(self.rows, 1))


def group_aware_order(diag: torch.Tensor, group_size: int) -> torch.Tensor:
    """Column permutation: groups by descending total ``diag(H)``, and within each
    group its columns by descending ``diag(H)``. Groups stay contiguous and whole."""
    k = diag.numel()
    per_group = diag.view(k // group_size, group_size)
    group_rank = per_group.sum(dim=1).argsort(descending=True)
    within = per_group.argsort(dim=1, descending=True)
    return (group_rank.unsqueeze(1) * group_size + within[group_rank]).reshape(-1)


@dataclasses.dataclass
class QuantizedLayer:
    codes: torch.Tensor
    """[N, K] int32 codes in 0..15, original column order."""
    scales: torch.Tensor
    """[N, K/g] fp32 values, exact in bf16 (and in fp16 on the symmetric grid)."""
    group_size: int
    ratios: torch.Tensor
    """[N, K/g] the search's chosen ``f`` per scale (1.0 without a search)."""
    offsets: torch.Tensor | None = None
    """[N, K/g] fp32 values exact in bf16 on the asymmetric grid; None when symmetric."""

    def dequantize(self) -> torch.Tensor:
        scales = self.scales.repeat_interleave(self.group_size, dim=1)
        w = (self.codes.to(torch.float32) - ZERO) * scales
        if self.offsets is not None:
            w += self.offsets.repeat_interleave(self.group_size, dim=1)
        return w


def quantize_layer(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    grid: Grid,
    damp: float = 0.05,
    group_order: bool = True,
) -> QuantizedLayer:
    """GPTQ with the per-group ``grid`` (module docstring). ``damp`` is the
    fraction of ``mean(diag H)`` added to the diagonal (GPTQModel's default, 0.05)."""
    n, k = weight.shape
    assert hessian.shape == (k, k), f"Hessian {tuple(hessian.shape)} for a [{n}, {k}] weight"
    assert k % group_size == 0, f"group size {group_size} does not divide {k}"
    w = weight.to(torch.float32).clone()
    h = hessian.to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    perm = group_aware_order(torch.diagonal(h), group_size) if group_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h_search = h.to(torch.float32)  # the objective's H: undamped
    h = h + damp * torch.diagonal(h).mean() * torch.eye(k, dtype=torch.float64)
    try:
        chol = torch.linalg.cholesky(h)
    except torch.linalg.LinAlgError as e:
        raise ValueError(f"the Hessian is not positive definite even with damping {damp}: {e}") from None
    u = torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True).to(torch.float32)

    codes = torch.empty(n, k, dtype=torch.int32)
    scales = torch.empty(n, k // group_size, dtype=torch.float32)
    offsets = None if grid.symmetric else torch.empty_like(scales)
    chosen = torch.empty_like(scales)
    block = group_size * max(1, 128 // group_size)  # whole groups per block
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w_blk = w[:, b0:b1].clone()
        err_blk = torch.zeros_like(w_blk)
        u_blk = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                g = slice(col, col + group_size)
                group_scales, group_offsets, ratios = grid.choose(w_blk[:, i:i + group_size], h_search[g, g])
                scales[:, int(perm[col]) // group_size] = group_scales
                chosen[:, int(perm[col]) // group_size] = ratios
                if offsets is not None:
                    offsets[:, int(perm[col]) // group_size] = group_offsets
            c = quantize_codes(w_blk[:, i:i + 1], group_scales, group_offsets).squeeze(1)
            codes[:, col] = c.to(torch.int32)
            e = (w_blk[:, i] - dequantize_codes(c.unsqueeze(1), group_scales, group_offsets).squeeze(1)) / u_blk[i, i]
            w_blk[:, i:] -= e.unsqueeze(1) * u_blk[i, i:].unsqueeze(0)
            err_blk[:, i] = e
        w[:, b1:] -= err_blk @ u[b0:b1, b1:]

    original = torch.empty_like(codes)
    original[:, perm] = codes
    return QuantizedLayer(codes=original, scales=scales, group_size=group_size, ratios=chosen, offsets=offsets)


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |ref - approx|^2)."""
    ref = reference.to(torch.float64)
    noise = (ref - approx.to(torch.float64)).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)
