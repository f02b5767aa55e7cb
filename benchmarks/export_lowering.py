"""Where the phone export's time goes: ``phone.xnnpack.export``'s steps, timed on the
default model cut to a few decoder layers, with the token dimension dynamic (the
program's one-call prefill) and static (one length), interleaved.

Steps: ``torch.export`` of ``CustomOpsDecoder``, the decomposition of torchao's
tensors, ``to_edge_transform_and_lower`` (ExecuTorch's edge passes, then XNNPACK's
per partition), ``to_executorch``. Within the lowering, the XNNPACK passes that
match pattern graphs of ops an LLM does not have (bilinear upsampling, SDPA: the
program's attention is ExecuTorch's custom op) are timed apart. The slope between
two layer counts is the cost per decoder layer; the w8a8 recipe (no GPTQ) is
lowered, the 4-bit one has the same graph.

    .venv/bin/python -m benchmarks.export_lowering     # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from pathlib import Path

from .common import RESULTS, ROOT, host, stage, today, write_json

LAYERS = (2, 4)
MAX_SEQ_LEN = 256


@contextlib.contextmanager
def timed_calls(owner, name: str, into: dict[str, float]):
    """Add the time of every call of ``owner.name`` to ``into[name]`` while open."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into[f"{owner.__name__}.{name}"] += time.perf_counter() - started

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def lower(model_dir: Path, layers: int, dynamic: bool) -> dict[str, float]:
    import torch
    from executorch.backends.xnnpack._passes.convert_to_sdpa import ConvertToSDPAPass
    from executorch.backends.xnnpack._passes.convert_to_upsample_bilinear2d import ConvertToUpsampleBilinear2d
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass
    from transformers import AutoModelForCausalLM

    from edgepath.phone import xnnpack

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    xnnpack.quantize_8da8w(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            module.padding_idx = None  # as xnnpack.export does
    times: dict[str, float] = defaultdict(float)
    with torch.no_grad():
        decoder = xnnpack.CustomOpsDecoder(model, MAX_SEQ_LEN).eval()
        example = (torch.tensor([[0, 0]], dtype=torch.long), torch.tensor([0], dtype=torch.long))
        shapes = ({1: torch.export.Dim("tokens", min=1, max=MAX_SEQ_LEN - 1)}, None) if dynamic else None
        started = time.perf_counter()
        program = torch.export.export(decoder, example, dynamic_shapes=shapes, strict=True)
        times["torch_export"] = time.perf_counter() - started
        started = time.perf_counter()
        program = program.run_decompositions({})
        times["decompositions"] = time.perf_counter() - started
        started = time.perf_counter()
        with timed_calls(ConvertToUpsampleBilinear2d, "call", times), timed_calls(ConvertToSDPAPass, "call", times):
            edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()],
                                               compile_config=EdgeCompileConfig(_check_ir_validity=False))
        times["lowering"] = time.perf_counter() - started
        times["partitions"] = sum(1 for n in edge.exported_program().graph.nodes
                                  if n.op == "get_attr" and n.name.startswith("lowered_module"))
        started = time.perf_counter()
        config = ExecutorchBackendConfig(extract_delegate_segments=True, do_quant_fusion_and_const_prop=True,
                                         memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
                                         sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass())
        edge.to_executorch(config)
        times["to_executorch"] = time.perf_counter() - started
    return {k: round(v, 2) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    import torch

    torch.set_num_threads(1)  # the export stage lowers on one core
    model_record = ROOT / "build" / "model" / "model.json"
    if not model_record.is_file():
        stage("model", "--out", str(model_record.parent))
    rows = []
    for layers in LAYERS:
        for dynamic in (True, False):
            row = {"layers": layers, "tokens": "dynamic" if dynamic else "static",
                   **lower(model_record.parent / "hf", layers, dynamic)}
            rows.append(row)
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    per_layer = {kind: round((by[LAYERS[1]] - by[LAYERS[0]]) / (LAYERS[1] - LAYERS[0]), 2)
                 for kind in ("dynamic", "static")
                 for by in [{r["layers"]: r["lowering"] for r in rows if r["tokens"] == kind}]}
    print(f"lowering per decoder layer: {per_layer}", flush=True)
    write_json(RESULTS / "export_lowering.json", {
        "date": today(), "host": host(), "command": "python -m benchmarks.export_lowering", "threads": 1,
        "max_seq_len": MAX_SEQ_LEN, "rows": rows, "lowering_s_per_layer": per_layer})


if __name__ == "__main__":
    main()
