"""The unquantized family: ``bf16`` and ``fp16``, the model stage's checkpoint as it is,
for GPUs (vLLM with the path's dtype). Nothing is built or checked: the benchmark
runs the model's own bf16 checkpoint as the reference every build is compared
with (``benchmark_arm``), and ``edgepath serve`` serves it with vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..rules.weight_paths import Engine, Stage
from . import WeightPath, one_file, register
from .vllm_checkpoint import vllm_server_command


@register
class UnquantizedPath(WeightPath):
    """``bf16`` and ``fp16`` (module docstring)."""

    engine = Engine.VLLM
    built_by = Stage.MODEL

    def benchmark_arm(self, artifact: Path, parameters: int, name: str | None = None, role: str = "build"):
        """vLLM over the model's own checkpoint ``artifact`` on this CPU, with bf16
        activations whatever the path's environment."""
        from ..engines.worker import Arm
        from ..formats.hf_model import stored_bytes

        total, per_token = stored_bytes(artifact)
        env = {**self.spec.process_env(), "VLLM_CPU_INT4_W4A8": "0"}
        return Arm(name or self.spec.name, role, self.engine.value, artifact, None, tuple(sorted(env.items())),
                   round(total * 8 / parameters, 3), per_token)

    def served_model(self, build, host) -> Path:
        return one_file(build, "checkpoint folders (config.json)", lambda n: Path(n).name == "config.json").parent

    def server_command(self, model: Path, name: str, host: str, port: int, parallel: int, context: int,
                       engine_args: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, Any]]:
        return vllm_server_command(self.spec, model, name, host, port, parallel, context, engine_args, environ)
