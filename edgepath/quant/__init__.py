"""4-bit weight quantization: calibration, the GPTQ core with its scale search,
and the on-disk formats the CPU kernels read. One module per concern."""
