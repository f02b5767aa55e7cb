"""Layer-by-layer GPTQ over a Hugging Face decoder (Llama family).

Lifecycle: the calibration tokens run through the embeddings once; the inputs
of decoder layer 0 are kept. Then, per layer and per group of linears that
read the same input (q/k/v, o, gate/up, down, in that order: "true
sequential"), the group's input Hessian is accumulated over a forward pass of
the layer, every linear of the group is quantized, and its weight is replaced
by the dequantized one, so each later group sees the error of the earlier
ones. The layer's output on the quantized weights is the next layer's input.
Finally the output head, if asked, is quantized on the final norm's output.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Collection, Iterator

import torch

from ..core.errors import EdgepathError
from .gptq import Grid, HessianAccumulator, QuantizedLayer, quantize_layer

# Linears of one decoder layer, grouped by shared input, in data-flow order.
SEQUENTIAL_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
HEAD = "lm_head"


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """GPTQ's column loop is small ops in sequence: on 2 busy cores it ran 30-100x
    slower with two threads than with one (measured here, issue 3)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Captured(Exception):
    pass


def decoder_inputs(model, tokens: torch.Tensor, batch_size: int) -> tuple[list[torch.Tensor], dict]:
    """Inputs of decoder layer 0 for each batch, and the keyword arguments it is
    called with (positions, rotary embeddings, mask), identical for every batch."""
    inputs: list[torch.Tensor] = []
    kwargs: dict = {}

    def grab(_module, args, kw):
        inputs.append(args[0] if args else kw.pop("hidden_states"))
        kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})
        raise _Captured

    handle = model.model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for batch in tokens.split(batch_size):
            with contextlib.suppress(_Captured):
                model(input_ids=batch, use_cache=False)
    finally:
        handle.remove()
    kwargs["use_cache"] = False
    kwargs.pop("past_key_values", None)
    return inputs, kwargs


def forward_layer(layer, inputs: list[torch.Tensor], kwargs: dict) -> list[torch.Tensor]:
    outs = []
    for x in inputs:
        y = layer(x, **kwargs)
        outs.append(y[0] if isinstance(y, tuple) else y)
    return outs


def _input_hessian(module, layer, inputs: list[torch.Tensor], kwargs: dict) -> torch.Tensor:
    """The Hessian of ``module``'s input over every batch. The layer's forward stops
    at ``module``: what comes after it cannot change its input (halves the cost)."""
    acc = HessianAccumulator(module.in_features)

    def take(_module, args):
        acc.add(args[0])
        raise _Captured

    handle = module.register_forward_pre_hook(take)
    try:
        for x in inputs:
            with contextlib.suppress(_Captured):
                layer(x, **kwargs)
    finally:
        handle.remove()
    return acc.h


def check_architecture(model) -> None:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        raise EdgepathError(f"{type(model).__name__}: no decoder layers at model.layers")
    names = {n for n, m in layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    expected = {n for group in SEQUENTIAL_GROUPS for n in group}
    if names != expected:
        raise EdgepathError(
            f"{type(model).__name__}: decoder layer linears {sorted(names)} are not the Llama-family set "
            f"{sorted(expected)} this quantizer knows how to order")


def quantize_model(
    model,
    tokens: torch.Tensor,
    group_size: int,
    grid: Grid,
    damp: float,
    group_order: bool,
    quantize_head: bool,
    keep: Collection[str] = (),
    batch_size: int = 8,
) -> dict[str, QuantizedLayer]:
    """Quantize ``model`` (fp32, eval) in place to its dequantized 4-bit weights, but
    for the linears whose prefix is in ``keep`` (a path that stores them at more bits);
    returns the quantized layers by state-dict prefix. Progress goes to stderr."""
    check_architecture(model)
    layers = model.model.layers
    results: dict[str, QuantizedLayer] = {}
    start = time.monotonic()

    def quantize(prefix: str, module: torch.nn.Linear, hessian: torch.Tensor) -> None:
        with _torch_threads(1):
            q = quantize_layer(module.weight.data, hessian, group_size, grid, damp, group_order)
        module.weight.data = q.dequantize().to(module.weight.dtype)
        results[prefix] = q

    with torch.no_grad():
        inputs, kwargs = decoder_inputs(model, tokens, batch_size)
        for li, layer in enumerate(layers):
            for group in SEQUENTIAL_GROUPS:
                names = [n for n in group if f"model.layers.{li}.{n}" not in keep]
                if not names:
                    continue
                modules = [layer.get_submodule(n) for n in names]
                # the group shares one input, so one Hessian serves all its linears
                hessian = _input_hessian(modules[0], layer, inputs, kwargs)
                for name, module in zip(names, modules):
                    quantize(f"model.layers.{li}.{name}", module, hessian)
            inputs = forward_layer(layer, inputs, kwargs)
            print(f"quantize: layer {li + 1}/{len(layers)} done, {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)
        if quantize_head:
            head = model.get_output_embeddings()
            if head.weight is model.get_input_embeddings().weight:
                # untie: the embedding table stays unquantized for its lookups
                head.weight = torch.nn.Parameter(head.weight.detach().clone())
                model.config.tie_word_embeddings = False
            acc = HessianAccumulator(head.in_features)
            for x in inputs:
                acc.add(model.model.norm(x))
            quantize(HEAD, head, acc.h)
            print(f"quantize: output head done, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return results
