"""The format class of a 4-bit checkpoint, from its config's ``quant_method``."""


def layer_format(quant_method: str):
    """The class of one layer in ``quant_method``'s checkpoint format (``pack``,
    ``tensors``, ``from_tensors``, ``dequantize``)."""
    if quant_method == "gptq":
        from .gptq_format import GptqV1Int4

        return GptqV1Int4
    if quant_method == "cpu_int4":
        from .cpu_int4_format import CpuInt4

        return CpuInt4
    from ..core.errors import EdgepathError

    raise EdgepathError(f"no checkpoint format edgepath reads has quant_method {quant_method!r}")
