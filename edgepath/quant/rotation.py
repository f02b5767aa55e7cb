"""Rotations folded into a Llama-family decoder before GPTQ (QuaRot's R1 and R2).

An orthogonal rotation of a linear's input spreads a few outlier channels over all of
them, so per-group 4-bit weights and per-token 8-bit activations round with less
error; folded into the weights offline it costs nothing at run time.

Lifecycle: ``rotate(model, seed)`` changes the fp32 model in place and returns a
``Rotation``; the model's outputs are unchanged (exact in real arithmetic, ~1e-5 of
the logits in fp32). In order:

1. **Norms folded.** Every RMSNorm's gain ``g`` moves into the columns of the linears
   that read it (``W <- W diag(g)``: q/k/v, gate/up, the head) and becomes 1: an
   RMSNorm without gain commutes with any rotation of its input.
2. **Head untied** where the model ties it to the embedding table: the two get
   different rotations' sides below.
3. **R1**, one random Hadamard ``Q [d, d]`` of the residual stream: the stream ``h``
   becomes ``h Q``. The embedding table ``E <- E Q``; a linear reading the stream
   ``W <- W Q`` (q/k/v, gate/up, head); a linear writing it ``W <- Q^T W`` (o, down).
4. **R2**, one random Hadamard ``R [head_dim, head_dim]``, per head on the values and
   the attention output: each key-value head's rows of v ``W_h <- R^T W_h`` (and its
   bias ``b_h <- b_h R``), o's columns of each query head ``W_h <- W_h R``. Attention
   mixes positions, not a head's channels, so every query head's output is its value
   head's rotated by the same ``R``.

No online rotation (QuaRot's R3/R4) is inserted: each would be an op in the engine.

The Hessians GPTQ needs follow without a pass over the model: a linear whose input
``x`` became ``x T`` has ``H' = T^T H T`` (``Rotation.hessians``), with
``T = diag(1/g) Q`` for the readers of a folded norm, ``blockdiag(R, ...)`` for o and
the identity for down. So the calibrate stage's Hessians of the unrotated model serve
a rotated build too.

``hadamard(n)``: Sylvester's construction for powers of two, Kronecker products with
Paley's for the other factors (orders ``q + 1`` for a prime ``q = 3 mod 4``, ``2(q + 1)``
for ``q = 1 mod 4``): SmolLM2's 576 is 36 x 16, Qwen2.5-1.5B's 1536 is 12 x 128.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from ..core.errors import EdgepathError
from .sequential import HEAD, check_architecture, shared_input

READS_INPUT_NORM = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
READS_POST_ATTENTION_NORM = ("mlp.gate_proj", "mlp.up_proj")
WRITES_STREAM = ("self_attn.o_proj", "mlp.down_proj")


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % p for p in range(2, int(q**0.5) + 1))


def _paley(q: int) -> torch.Tensor:
    """Paley's Hadamard matrix from the prime ``q``: order ``q + 1`` (``q = 3 mod 4``) or
    ``2(q + 1)`` (``q = 1 mod 4``)."""
    residues = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0] + [1 if a in residues else -1 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jacobsthal = chi[(idx[None, :] - idx[:, None]) % q]
    ones = torch.ones(q, dtype=torch.float64)
    if q % 4 == 3:
        s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = ones, -ones, jacobsthal
        return s + torch.eye(q + 1, dtype=torch.float64)
    conference = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    conference[0, 1:], conference[1:, 0], conference[1:, 1:] = ones, ones, jacobsthal
    a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(conference, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)


@functools.cache
def _paley_orders(limit: int) -> dict[int, int]:
    """Order -> the prime of a Paley matrix of that order, for orders up to ``limit``
    that are not powers of two."""
    orders = {}
    for q in range(3, limit):
        if _is_prime(q):
            order = q + 1 if q % 4 == 3 else 2 * (q + 1)
            if order <= limit and order & (order - 1):
                orders.setdefault(order, q)
    return orders


@functools.cache
def hadamard(n: int) -> torch.Tensor:
    """A Hadamard matrix of order ``n`` (entries +-1, ``H H^T = n I``, fp64); refused
    where this module's constructions have none (module docstring)."""
    if n < 1:
        raise EdgepathError(f"no Hadamard matrix of order {n}")
    if n & (n - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        return h
    for order, q in sorted(_paley_orders(n).items(), reverse=True):
        if n % order == 0:
            with_rest = _try_hadamard(n // order)
            if with_rest is not None:
                return torch.kron(_paley(q), with_rest)
    raise EdgepathError(f"no Hadamard matrix of order {n} from Sylvester's and Paley's constructions")


def _try_hadamard(n: int) -> torch.Tensor | None:
    try:
        return hadamard(n)
    except EdgepathError:
        return None


def random_hadamard(n: int, generator: torch.Generator) -> torch.Tensor:
    """An orthogonal ``[n, n]`` (fp64): ``hadamard(n)`` with random signs on its rows,
    scaled by ``1/sqrt(n)``."""
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.float64) * 2 - 1
    return signs[:, None] * hadamard(n) / n**0.5


@dataclasses.dataclass(frozen=True)
class Rotation:
    """What ``rotate`` did: the record's description and, per Hessian key
    (``sequential.shared_input``), the matrix ``T`` with which its linears' input became
    ``x T``."""

    seed: int
    rotations: tuple[str, ...]
    transforms: dict[str, torch.Tensor] = dataclasses.field(repr=False)

    def record(self) -> dict[str, object]:
        return {"rotations": list(self.rotations), "kind": "random Hadamard", "seed": self.seed}

    def hessians(self, hessian_of: Callable[[int | None], dict[str, torch.Tensor]]
                 ) -> Callable[[int | None], dict[str, torch.Tensor]]:
        """``hessian_of`` (the unrotated model's, ``quantize_from_hessians``'s argument)
        for the rotated model: ``H' = T^T H T``."""

        def rotated(layer: int | None) -> dict[str, torch.Tensor]:
            out = {}
            for key, h in hessian_of(layer).items():
                t = self.transforms.get(key)
                out[key] = h if t is None else t.t() @ h.to(torch.float64) @ t
            return out

        return rotated


def _fold_norm(norm: torch.nn.Module, linears: list[torch.nn.Linear], where: str) -> torch.Tensor:
    """Move ``norm``'s gain into ``linears``' input columns; returns the gain (fp64)."""
    gain = norm.weight.detach().to(torch.float64).clone()
    if bool((gain == 0).any()):
        raise EdgepathError(f"{where}: a norm gain of 0; its channel cannot be rotated into the others "
                            f"(calibrate and quantize this model unrotated)")
    for linear in linears:
        linear.weight.copy_((linear.weight.to(torch.float64) * gain[None, :]).to(linear.weight.dtype))
    norm.weight.fill_(1.0)
    return gain


def _rotate_input(linear: torch.nn.Linear, q: torch.Tensor) -> None:
    linear.weight.copy_((linear.weight.to(torch.float64) @ q).to(linear.weight.dtype))


def _rotate_output(linear: torch.nn.Linear, q: torch.Tensor) -> None:
    linear.weight.copy_((q.t() @ linear.weight.to(torch.float64)).to(linear.weight.dtype))
    if linear.bias is not None:
        linear.bias.copy_((linear.bias.to(torch.float64) @ q).to(linear.bias.dtype))


@torch.no_grad()
def rotate(model, seed: int, values: bool = True) -> Rotation:
    """Fold ``model``'s norms and its R1 (and, with ``values``, R2) in place (module
    docstring); the random Hadamards are drawn from ``seed``."""
    check_architecture(model)
    config = model.config
    d = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    generator = torch.Generator().manual_seed(seed)
    r1 = random_hadamard(d, generator)
    r2 = random_hadamard(head_dim, generator) if values else None

    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        config.tie_word_embeddings = False
    embedding = model.get_input_embeddings()
    embedding.weight.copy_((embedding.weight.to(torch.float64) @ r1).to(embedding.weight.dtype))

    transforms = {}
    for li, layer in enumerate(model.model.layers):
        for norm, names in ((layer.input_layernorm, READS_INPUT_NORM),
                            (layer.post_attention_layernorm, READS_POST_ATTENTION_NORM)):
            linears = [layer.get_submodule(n) for n in names]
            gain = _fold_norm(norm, linears, f"layer {li}")
            for linear in linears:
                _rotate_input(linear, r1)
            transforms[shared_input(f"model.layers.{li}.{names[0]}")] = (1 / gain)[:, None] * r1
        attention = layer.self_attn
        if r2 is not None:
            heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
            _rotate_output(attention.v_proj, torch.block_diag(*[r2] * kv_heads))
            o_input = torch.block_diag(*[r2] * heads)
            _rotate_input(attention.o_proj, o_input)
            transforms[f"model.layers.{li}.self_attn.o_proj"] = o_input
        for name in WRITES_STREAM:
            _rotate_output(layer.get_submodule(name), r1)
    gain = _fold_norm(model.model.norm, [head], "final norm")
    _rotate_input(head, r1)
    transforms[HEAD] = (1 / gain)[:, None] * r1
    return Rotation(seed, ("R1", "R2") if values else ("R1",), transforms)
