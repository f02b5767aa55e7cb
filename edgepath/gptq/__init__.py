"""GPTQ and the checkpoints it writes: the GPTQ core with its per-group scale search
(``gptq``), the layer-by-layer driver (``sequential``), held-out perplexity
(``evaluate``), and one class per on-disk format the CPU kernels read
(``gptq_format``, ``cpu_int4_format``). One module per concern; the quantize stage
(``edgepath.quantize``) runs them, on calibration windows from ``edgepath.calibration``."""


def layer_format(quant_method: str):
    """The class of one layer in ``quant_method``'s checkpoint format (``pack``,
    ``tensors``, ``from_tensors``, ``dequantize``)."""
    if quant_method == "gptq":
        from .gptq_format import GptqV1Int4

        return GptqV1Int4
    if quant_method == "cpu_int4":
        from .cpu_int4_format import CpuInt4

        return CpuInt4
    from ..errors import EdgepathError

    raise EdgepathError(f"no checkpoint format edgepath reads has quant_method {quant_method!r}")
