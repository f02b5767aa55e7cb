"""The pipeline's stages, one module each, in pipeline order: ``model``, ``probe``,
``select``, ``quantize`` (with its ``engine_check``), ``patch_verify``, ``control``,
``export``, ``benchmark``, ``manifest``, ``bundle``; and ``params``, the check of
params.yaml that runs before them. Each ends with its ``COMMAND``; ``stages/<name>.py``
at the project root is its DVC entry point. A stage is a loop over paths: what
differs from one path to another is asked of the path's family (``edgepath.paths``)."""
