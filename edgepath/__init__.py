"""edgepath: one language model, a fleet of devices, the fastest faithful build for each.

The decision logic (profile -> weight path -> manifest) lives in plain-Python
modules with no heavy imports: ``profile``, ``probe``, ``select``, ``shapes``,
``fleet``, ``hf_model``, ``manifest``. Engines (transformers, later vLLM,
ExecuTorch, llama.cpp) sit behind adapters in ``edgepath.engines`` and are
imported only by the stage that needs them.
"""

__version__ = "0.1.0"
