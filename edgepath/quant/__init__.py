"""4-bit weight quantization: calibration, the GPTQ core with its scale search,
and the on-disk formats the CPU kernels read. One module per concern."""


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
