"""The measurement suite: what the pipeline's own benchmark stage does not measure.

The product's measurement is the benchmark stage (``dvc repro benchmark``: every
build against llama.cpp's controls, interleaved, per held-out genre; its record
``build/benchmark/benchmark.json``). The modules here answer the questions behind
its defaults and its engines' settings, each run from the project root as a
module, on a host that runs nothing else::

    .venv/bin/python -m benchmarks.<name> --help

============================ ===========================================================
module                       its question (its record in benchmarks/results/)
============================ ===========================================================
``builds``                   where a batch-1 decode step's time goes in vLLM (builds.md)
``calibration``              which calibration text and GPTQ settings generalize, per
                             held-out genre (calibration.md)
``gguf_mix``                 which tensors the GGUF stores above 4 bits (gguf_mix.md)
``phone_calibration``        how the QNN program must be calibrated (phone.md)
``phone_xnnpack``            the XNNPACK programs' fidelity and speed in ExecuTorch's
                             runtime (phone.md; the registry reads its record)
``plugin``                   the vLLM plugin's defaults (plugin.md)
``quantize``                 how faithful each quantizer variant is (quantize.md)
``remote``                   push and pull throughput to a directory and an S3 remote
                             (remote.md)
``serving``                  serving throughput, vLLM's server against llama-server,
                             driven by ``vllm bench serve`` (serving.md)
``shape_1b``                 the builds at a 1B model's shapes (serving_1b.md)
``step_cost``                vLLM's per-step cost, one configuration lever at a time
                             (step_cost.md)
============================ ===========================================================

``common`` holds what they share: the host and load record every result names, the
summary of repeated samples, the JSON and CSV writers. A record the registry's
figures come from lives in ``edgepath/rules/measured/`` (``rules.measurements``).
"""
