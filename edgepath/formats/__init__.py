"""On-disk formats, one class per format with its exact layout in its docstring: GPTQ
v1 symmetric int4 (``gptq_format``), cpu_int4 for tinygemm (``cpu_int4_format``),
GGUF Q4_0 blocks (``gguf_q4_0_format``); and the Hugging Face model directory every
stage reads (``hf_model``). ``checkpoint.layer_format`` names the class of a
checkpoint's ``quant_method``."""
