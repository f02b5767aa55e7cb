"""QNN w8a16: a Qualcomm NPU's program, calibrated on real text.

"w8a16" is QNN's 16a8w (``QuantDtype.use_16a8w``): 8-bit per-channel weights and
16-bit *integer* activations whose ranges are fixed at export, so the ranges must
come from the activations the model really produces. Reported on a real phone NPU
(one decoder layer against fp32): traced on random tensors -1.6 dB SQNR, calibrated
on real text 36.9 dB. Measured here on SmolLM2-135M's whole program (SM8650
quantizer, 2-core AMD EPYC host, ``benchmarks/results/phone.md``): calibrated on
real text top-1 0.892 and 20.0 dB, on random token ids 0.789 and 10.0 dB.

Lifecycle of ``calibrate`` then ``save`` / ``lower``:

1. Trace ``graph.FullSequence`` with ``torch.export`` at the program's fixed window
   length, under ``no_grad`` (traced with grad enabled the graph carries a
   ``WrapWithSetGradEnabled`` node that ``prepare_pt2e`` cannot annotate).
2. Annotate with ``QnnQuantizer`` for the target SoC: observers on every
   activation, per-channel weights on every linear.
3. Calibrate: run the prepared graph over the calibration windows, real text
   (prose and chat turns with the chat special tokens) through the reference
   model, so each observer records the range that text produces.
4. Convert: observers become quantize/dequantize pairs with fixed parameters.
   The converted graph computes in fp32 what the NPU computes in integers (up to
   its rounding), so its parity against the fp32 reference (``parity.Parity``
   over held-out windows) is the export's fidelity figure.
5. ``save``: the converted graph, re-exported, as a ``torch.export`` program file.
6. ``lower``: only where Qualcomm's QNN SDK is installed (``QNN_SDK_ROOT`` with its
   x86_64 ``libQnnHtp.so``): the converted graph lowered to a QNN ``.pte`` for the SoC.
   No registry reachable from this project's build hosts provides the SDK.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import graph

# Activation x weight precisions this module builds: w8a16 is the deliverable; w8a8
# is built only to show it breaks (benchmarks/phone_calibration.py).
PRECISIONS = ("w8a16", "w8a8")
SDK_LIBRARY = "lib/x86_64-linux-clang/libQnnHtp.so"


def sdk_missing() -> str | None:
    """Why a QNN ``.pte`` cannot be lowered on this host, or None when it can."""
    root = os.environ.get("QNN_SDK_ROOT", "")
    if not root:
        return ("QNN_SDK_ROOT is not set: lowering needs Qualcomm's QNN SDK (its x86_64 libQnnHtp.so), "
                "which is distributed by Qualcomm only, not by any package registry this build can reach")
    if not (Path(root) / SDK_LIBRARY).is_file():
        return f"QNN_SDK_ROOT={root} has no {SDK_LIBRARY}"
    return None


def _chipsets():
    """ExecuTorch's ``QcomChipset``. Set but empty, ``QNN_SDK_ROOT`` stops ExecuTorch's QNN
    package from downloading Qualcomm's SDK when it is imported; a real SDK root is kept."""
    os.environ.setdefault("QNN_SDK_ROOT", "")
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset

    return QcomChipset


def soc_known(soc: str) -> bool:
    return hasattr(_chipsets(), soc)


def _quantizer(precision: str, soc: str):
    chipsets = _chipsets()
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype

    dtype = {"w8a16": QuantDtype.use_16a8w, "w8a8": QuantDtype.use_8a8w}[precision]
    quantizer = QnnQuantizer(soc_model=getattr(chipsets, soc))
    quantizer.set_default_quant_config(dtype, is_linear_per_channel=True, is_conv_per_channel=True)
    return quantizer


@torch.no_grad()
def calibrate(model, calibration: torch.Tensor, precision: str, soc: str, progress=None) -> torch.fx.GraphModule:
    """Steps 1-4: the converted graph of ``model`` calibrated on ``calibration``
    (``[samples, L]`` token ids; ``L`` is the program's window)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    assert precision in PRECISIONS, precision
    length = calibration.shape[1]
    mask, positions = graph.causal_inputs(length)
    traced = torch.export.export(graph.FullSequence(model), (calibration[:1], mask, positions))
    prepared = prepare_pt2e(traced.module(), _quantizer(precision, soc))
    for i, window in enumerate(calibration):
        prepared(window[None], mask, positions)
        if progress:
            progress(i + 1, len(calibration))
    converted = convert_pt2e(prepared)
    # the graph reads its folded int8 weight constants; the fp32 parameters it was traced
    # from would otherwise be saved with it (the 135M model's program: 805 MB with them)
    converted.delete_all_unused_submodules()
    return converted


@torch.no_grad()
def parity(model, converted: torch.fx.GraphModule, windows: torch.Tensor) -> dict:
    """``parity.Parity`` of ``converted`` against ``model`` (fp32) over ``windows``
    (``[n, L]`` held-out token ids, ``L`` the program's window)."""
    from .parity import Parity

    mask, positions = graph.causal_inputs(windows.shape[1])
    reference, measured = graph.FullSequence(model), Parity()
    for window in windows:
        measured.add(reference(window[None], mask, positions), converted(window[None], mask, positions))
    return measured.result()


@torch.no_grad()
def save(converted: torch.fx.GraphModule, length: int, path: Path) -> None:
    """Step 5: ``converted`` as a ``torch.export`` program file (``load``
    reads it back; its inputs are ``graph.FullSequence``'s at window ``length``)."""
    mask, positions = graph.causal_inputs(length)
    program = torch.export.export(converted, (torch.zeros(1, length, dtype=torch.long), mask, positions))
    torch.export.save(program, str(path))


def load(path: Path) -> torch.fx.GraphModule:
    """The program ``save`` wrote, as a callable module (``graph.FullSequence``'s inputs)."""
    import torchao.quantization.pt2e  # noqa: F401  (registers the quantized_decomposed ops it calls)

    return torch.export.load(str(path)).module()


def lower(converted: torch.fx.GraphModule, length: int, soc: str, path: Path) -> None:
    """Step 6: ``converted`` as a QNN HTP ``.pte`` for ``soc``; needs the SDK (``sdk_missing``)."""
    chipsets = _chipsets()
    from executorch.backends.qualcomm.utils.utils import (generate_htp_compiler_spec,
                                                          generate_qnn_executorch_compiler_spec,
                                                          to_edge_transform_and_lower_to_qnn)

    mask, positions = graph.causal_inputs(length)
    specs = generate_qnn_executorch_compiler_spec(
        soc_model=getattr(chipsets, soc), backend_options=generate_htp_compiler_spec(use_fp16=False))
    edge = to_edge_transform_and_lower_to_qnn(
        converted, (torch.zeros(1, length, dtype=torch.long), mask, positions), specs)
    path.write_bytes(edge.to_executorch().buffer)
