"""Adapters to the engines edgepath runs or converts models with, one module each:

- ``vllm_cpu``: vLLM on the CPU in this process (``VllmCpu``), for the engine
  check, and inside ``worker`` for patch-verify and the benchmark;
- ``llama_cpp``: llama.cpp through ``llama-cpp-python``: the control stage's GGUF
  converter and quantizer, and the benchmark's control engine;
- ``transformers_gguf``: the model stage's GGUF -> bf16 Hugging Face conversion;
- ``executorch_runtime``: ExecuTorch's runtime running the XNNPACK export's
  ``.pte`` (the export stage's check);
- ``worker``: one engine (vLLM or llama.cpp) in its own process, driven over a
  pipe (``python -m edgepath.engines.worker``): the one engine-process protocol,
  both its sides (``EngineProcess`` drives it; patch-verify's engine starts and
  the benchmark's arms).

``vllm_cpu``, ``llama_cpp`` and ``worker`` import their engine inside the
functions that use it; ``transformers_gguf`` (torch, transformers) and
``executorch_runtime`` (torch) import heavy libraries at import time, so import
those only in the stage that uses them."""
