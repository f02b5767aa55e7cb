"""edgepath: one language model, a fleet of devices, the fastest faithful build for each.

The package is layered; a module imports only from its own layer and those below
(pyproject.toml's ``[tool.importlinter]`` states the contracts, ``tests/test_layers.py``
checks them), top to bottom:

- ``cli``: composes every command under ``edgepath <name>``;
- ``delivery``: what users do with a build: pull, release, serve, images, containers;
- ``stages``: the pipeline's stages, one module each (``dvc.yaml`` runs them);
- ``engines``: adapters to vLLM, llama.cpp, ExecuTorch and transformers, and the
  vLLM plugin; ``phone``: the phone programs' algorithms;
- ``quant``: GPTQ and its layer-by-layer driver;
- ``formats`` (on-disk checkpoint formats, one class each), ``scoring`` (fidelity
  figures), ``text`` (corpora, calibration and held-out token sets, prompts);
- ``rules``: the decisions in plain Python (registry, shapes, coverage, profile,
  selection, params, versions), no engine;
- ``core``: errors, bounded file reading and hashing, atomic writes, records, commands.

Engines are imported only inside the functions that use them, so the decision
logic (profile -> weight path -> manifest) never loads torch.
"""

__version__ = "0.1.0"
