"""GPTQ over a Hugging Face decoder (Llama family), from shared or sequential inputs.

Two ways to feed GPTQ its Hessians:

- **Shared** (``input_hessians``, then ``quantize_from_hessians``): the
  unquantized model runs over the calibration tokens once, layer by layer, and
  the Hessian of every group of linears that read the same input (q/k/v, o,
  gate/up, down) is accumulated from its input. Any number of builds then
  quantize from the same Hessians without running the model: every linear is
  independent, so they are quantized in parallel, one per core. The calibrate
  stage computes them once per model.
- **True sequential** (``quantize_model``): the calibration tokens run through
  the embeddings once; the inputs of decoder layer 0 are kept. Then, per layer
  and per group of linears in data-flow order, the group's input Hessian is
  accumulated over a forward pass of the layer, every linear of the group is
  quantized, and its weight is replaced by the dequantized one, so each later
  group sees the error of the earlier ones. The layer's output on the
  quantized weights is the next layer's input. It costs about three forwards
  of the calibration tokens per build.

Either way the output head, if asked, is quantized on the final norm's output.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Collection, Iterator

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


@dataclasses.dataclass(frozen=True)
class GptqPlan:
    """What ``quantize_from_hessians`` and ``quantize_model`` round, and how: GPTQ's
    settings (``gptq.quantize_layer``), whether the output head is quantized (untied
    from the embedding), the linears left as they are (``keep``: prefixes a path
    stores at more bits) and the threads (default: one per core)."""

    group_size: int
    grid: Grid
    damp: float
    group_order: bool
    quantize_head: bool = False
    keep: Collection[str] = ()
    workers: int | None = None


def shared_input(prefix: str) -> str:
    """The key of the Hessian a linear reads (``model.layers.3.mlp.up_proj`` ->
    ``model.layers.3.mlp.gate_proj``): its group's first linear, or ``lm_head``."""
    if prefix == HEAD:
        return HEAD
    for group in SEQUENTIAL_GROUPS:
        for name in group:
            if prefix.endswith(f".{name}"):
                return prefix.removesuffix(name) + group[0]
    raise KeyError(f"{prefix}: not a linear GPTQ quantizes")


class _Captured(Exception):
    pass


def decoder_inputs(model, tokens: torch.Tensor, batch_size: int) -> tuple[list[torch.Tensor], dict]:
    """Inputs of decoder layer 0 for each batch, and the keyword arguments it is
    called with (positions, rotary embeddings, mask), identical for every batch: the
    batches are of one size, the largest at most ``batch_size`` that divides the
    samples (the rotary embeddings of a larger batch would broadcast over a smaller one)."""
    batch_size = max(d for d in range(1, batch_size + 1) if len(tokens) % d == 0)
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


def input_hessians(model, tokens: torch.Tensor, batch_size: int = 8) -> Iterator[dict[str, torch.Tensor]]:
    """Per decoder layer, then once for the output head: ``{key: H}`` (``shared_input``'s
    keys, ``H`` fp64 ``2/n sum x x^T``) from the unquantized ``model``'s inputs over
    ``tokens`` [samples, length]. One forward of the tokens in all; one layer's
    Hessians are held at a time."""
    check_architecture(model)
    with torch.no_grad():
        inputs, kwargs = decoder_inputs(model, tokens, batch_size)
        for li, layer in enumerate(model.model.layers):
            accumulators, handles = {}, []
            for group in SEQUENTIAL_GROUPS:
                module = layer.get_submodule(group[0])
                acc = accumulators[f"model.layers.{li}.{group[0]}"] = HessianAccumulator(module.in_features)
                handles.append(module.register_forward_pre_hook(lambda _m, args, acc=acc: acc.add(args[0])))
            try:
                inputs = forward_layer(layer, inputs, kwargs)
            finally:
                for handle in handles:
                    handle.remove()
            yield {key: acc.h for key, acc in accumulators.items()}
        head = HessianAccumulator(model.config.hidden_size)
        for x in inputs:
            head.add(model.model.norm(x))
        yield {HEAD: head.h}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _Rounding:
    """GPTQ on a pool of threads, one per core: ``run(jobs)`` quantizes each ``(prefix,
    linear, Hessian)`` in parallel, each torch op on one thread (GPTQ's column loop is
    small ops in sequence, which ran 30-100x slower on two threads each than on one,
    issue 3), and puts the dequantized weights in place."""

    def __init__(self, plan: GptqPlan) -> None:
        self.results = {}
        self.settings = (plan.group_size, plan.grid, plan.damp, plan.group_order)
        self.pool = concurrent.futures.ThreadPoolExecutor(plan.workers or _cores())

    def _quantize(self, job: tuple[str, torch.nn.Linear, torch.Tensor]) -> tuple[str, QuantizedLayer]:
        prefix, module, hessian = job
        torch.set_num_threads(1)  # per thread: the OpenMP setting is the calling thread's own
        return prefix, quantize_layer(module.weight.data, hessian, *self.settings)

    def run(self, jobs: list[tuple[str, torch.nn.Linear, torch.Tensor]]) -> None:
        for (prefix, q), (_, module, _) in zip(self.pool.map(self._quantize, jobs), jobs):
            module.weight.data = q.dequantize().to(module.weight.dtype)
            self.results[prefix] = q

    def __enter__(self) -> "_Rounding":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown()


def quantize_from_hessians(model, hessian_of: Callable[[int | None], dict[str, torch.Tensor]],
                            plan: GptqPlan) -> dict[str, QuantizedLayer]:
    """Quantize ``model`` in place, as ``quantize_model`` does, from shared Hessians:
    ``hessian_of(layer index)`` (None: the head's) returns that layer's
    ``{shared_input key: H}``. Each layer's linears are quantized in parallel on
    ``plan.workers`` threads. Progress goes to stderr."""
    check_architecture(model)
    start = time.monotonic()
    layers, keep = model.model.layers, plan.keep
    with torch.no_grad(), _Rounding(plan) as rounding:
        for li, layer in enumerate(layers):
            hessians = hessian_of(li)
            rounding.run([(f"model.layers.{li}.{name}", layer.get_submodule(name),
                           hessians[shared_input(f"model.layers.{li}.{name}")])
                          for group in SEQUENTIAL_GROUPS for name in group if f"model.layers.{li}.{name}" not in keep])
            del hessians
            print(f"quantize: layer {li + 1}/{len(layers)} done, {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)
        if plan.quantize_head:
            _untie_head(model)
            rounding.run([(HEAD, model.get_output_embeddings(), hessian_of(None)[HEAD])])
            print(f"quantize: output head done, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return rounding.results


def _untie_head(model) -> None:
    """The head gets a weight of its own: the embedding table stays unquantized for its lookups."""
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False


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


def quantize_model(model, tokens: torch.Tensor, plan: GptqPlan, batch_size: int = 8) -> dict[str, QuantizedLayer]:
    """Quantize ``model`` (fp32, eval) in place to its dequantized 4-bit weights, but
    for the linears whose prefix is in ``plan.keep``; returns the quantized layers by
    state-dict prefix. The linears of a group (one input) are quantized in parallel on
    ``plan.workers`` threads. Progress goes to stderr."""
    check_architecture(model)
    layers, keep = model.model.layers, plan.keep
    start = time.monotonic()
    with torch.no_grad(), _Rounding(plan) as rounding:
        inputs, kwargs = decoder_inputs(model, tokens, batch_size)
        for li, layer in enumerate(layers):
            for group in SEQUENTIAL_GROUPS:
                names = [n for n in group if f"model.layers.{li}.{n}" not in keep]
                if not names:
                    continue
                modules = [layer.get_submodule(n) for n in names]
                # the group shares one input, so one Hessian serves all its linears
                hessian = _input_hessian(modules[0], layer, inputs, kwargs)
                rounding.run([(f"model.layers.{li}.{n}", m, hessian) for n, m in zip(names, modules)])
            inputs = forward_layer(layer, inputs, kwargs)
            print(f"quantize: layer {li + 1}/{len(layers)} done, {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)
        if plan.quantize_head:
            _untie_head(model)
            head = model.get_output_embeddings()
            acc = HessianAccumulator(head.in_features)
            for x in inputs:
                acc.add(model.model.norm(x))
            rounding.run([(HEAD, head, acc.h)])
            print(f"quantize: output head done, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return rounding.results
