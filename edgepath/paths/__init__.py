"""Weight-path families: one module per kind of build, behind one interface.

A weight path's record (``rules.weight_paths``) says what the build is; its family
here is the only code that knows how the build is written, checked, verified,
measured, summarised for the manifest and served:

=================== ======================================== ============================
module              registry records                         engine adapter
=================== ======================================== ============================
``vllm_checkpoint`` w4a8-gptq, w4a16-tinygemm                ``engines.vllm_cpu``
``gguf``            q4_0-gguf                                ``engines.llama_cpp``
``executorch``      w8a16-qnn, w4a8-xnnpack, w8a8-xnnpack     ``engines.executorch_runtime``
``unquantized``     bf16, fp16                               ``engines.vllm_cpu``
=================== ======================================== ============================

Each module registers its class for the records it builds (``register``: by the
record's engine and building stage, the way llama.cpp's converter registers one
class per architecture), and ``of(spec)`` returns the family of a record. The
stages are loops that ask a path's family what to do; none names a path or
branches on an engine (``tests/test_paths.py``).

Lifecycle of a quantize-stage build, as the stages call its family:

1. quantize: ``refuse`` (settings the path cannot take, before any work),
   ``before_gptq`` (what the path fixes before GPTQ: tensors kept out of it),
   ``head_record``, then ``publish`` (pack, write, check in the real engine, publish
   atomically) and ``check_line`` (the command's summary of the check).
2. patch-verify: ``verify`` makes the record (the stage writes it, with its cost),
   ``verify_line`` summarises it.
3. benchmark: ``benchmark_arm``, the engine over the build.
4. manifest: ``check_kind`` and ``check_summary`` (the build's own check record),
   ``verified_detail`` (its patch-verify record).
5. serve: ``served_model`` (the file or folder the server loads, refused where the
   build does not run here) and ``server_command``.

Adding a path: a record in ``rules.weight_paths``; where no family builds it, one
module here with a class registered for it; its tests. Plain Python at import:
engines load inside the methods that run them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from ..core.errors import EdgepathError
from ..rules import weight_paths
from ..rules.weight_paths import Engine, Stage, WeightPathSpec


@dataclasses.dataclass
class QuantizedModel:
    """What the quantize stage hands ``WeightPath.publish`` once GPTQ has run."""

    model: Any
    """The PyTorch model (fp32), its quantized linears on GPTQ's grid; a family that
    needs the memory back sets it to None once it has read what it needs."""
    model_dir: Path
    info: dict[str, Any]
    """``formats.hf_model.inspect`` of ``model_dir``."""
    layers: dict[str, Any]
    """Prefix -> ``quant.gptq.QuantizedLayer``."""
    group: int
    kept: list[str]
    """Linears GPTQ left alone (``before_gptq``), stored at more bits."""
    check_sequences: dict[str, list[list[int]]]
    """The held-out windows the build's check is teacher-forced on (``text.calibration.check_sequences``)."""
    host: Any
    """This machine's profile (``rules.profile.HardwareProfile``): where the check runs."""


class WeightPath:
    """The family of the weight paths ``spec``'s engine and building stage name
    (module docstring). A method a family does not implement refuses by name."""

    engine: ClassVar[Engine]
    built_by: ClassVar[Stage]
    check_kind: ClassVar[str | None] = None
    """The record kind of the check a quantize-stage build writes beside its artifact."""

    def __init__(self, spec: WeightPathSpec) -> None:
        assert (spec.engine, spec.built_by) == (self.engine, self.built_by), \
            f"{spec.name}: a {spec.engine.value} path built by {spec.built_by.value}, not {type(self).__name__}'s"
        self.spec = spec

    def _not_for(self, what: str) -> EdgepathError:
        return EdgepathError(f"{self.spec.name} is a {self.engine.value} path built by the {self.built_by.value} "
                             f"stage: it has no {what}")

    # ------------------------------------------------------------ quantize
    def refuse(self, settings) -> None:
        """Refuse quantize settings (``stages.quantize.Settings``) this path cannot take."""

    def before_gptq(self, model, shared, settings, started: float) -> tuple[list[str], dict[str, Any]]:
        """(linears GPTQ must leave alone, report fields) once the model is loaded;
        ``shared``: the calibrate stage's output (``stages.calibrate.SharedCalibration``)."""
        return [], {}

    def head_record(self, settings) -> dict[str, Any]:
        """The quantization report's ``head``: how the output head is stored."""
        raise self._not_for("quantized checkpoint")

    def publish(self, built: QuantizedModel, report: dict[str, Any], settings, out: Path) -> None:
        """Pack ``built`` into the path's format, check it in its engine and publish ``out``
        whole (``records.output_directory``), or refuse and leave ``out`` as it was."""
        raise self._not_for("quantized checkpoint")

    def check_line(self, out: Path) -> str:
        """The quantize command's summary of the check ``publish`` wrote in ``out``."""
        raise self._not_for("quantized checkpoint")

    # ------------------------------------------------------------ patch-verify
    def verify(self, artifact: Path, model_dir: Path, host, corpus: str,
               holdout: tuple[str, ...]) -> dict[str, Any]:
        """patch-verify's record of ``artifact`` on ``host``."""
        raise self._not_for("patch-verify")

    def verify_line(self, record: dict[str, Any]) -> str:
        """The patch-verify command's summary of a record that ran."""
        raise self._not_for("patch-verify")

    # ------------------------------------------------------------ manifest
    def check_summary(self, check: dict[str, Any]) -> dict[str, Any]:
        """The manifest's summary of the build's own check record (``check_kind``)."""
        raise self._not_for("build check")

    def verified_detail(self, record: dict[str, Any], where: str) -> str:
        """The manifest's sentence on a passed patch-verify record, run ``where``."""
        raise self._not_for("patch-verify")

    # ------------------------------------------------------------ benchmark
    def benchmark_arm(self, artifact: Path, parameters: int, name: str | None = None, role: str = "build"):
        """The benchmark's arm (``engines.worker.Arm``) over ``artifact``."""
        raise self._not_for("benchmark arm")

    # ------------------------------------------------------------ serve
    def served_model(self, build, host) -> Path:
        """The file or folder of a pulled ``build`` (``delivery.serve.Build``) its server
        loads, refused where this machine cannot run it; ``host()`` probes its profile
        (called only by a family whose kernel depends on the CPU)."""
        raise self._not_for("server")

    def server_command(self, model: Path, name: str, host: str, port: int, parallel: int, context: int,
                       engine_args: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """(argv, environment) of the server over ``model``, named ``name``."""
        raise self._not_for("server")


_FAMILIES: dict[tuple[Engine, Stage], type[WeightPath]] = {}


def register(cls: type[WeightPath]) -> type[WeightPath]:
    """Class decorator: ``cls`` is the family of every record with its engine and stage."""
    key = (cls.engine, cls.built_by)
    assert key not in _FAMILIES, f"{cls.__name__}: {key} already has {_FAMILIES[key].__name__}"
    _FAMILIES[key] = cls
    return cls


def of(spec: WeightPathSpec | str) -> WeightPath:
    """The family of path ``spec`` (a record, or a path's name)."""
    if isinstance(spec, str):
        spec = weight_paths.get(spec)
    family = _FAMILIES.get((spec.engine, spec.built_by))
    if family is None:
        raise EdgepathError(f"{spec.name}: no family builds {spec.engine.value} paths of the {spec.built_by.value} "
                            f"stage (edgepath/paths/)")
    return family(spec)


def one_file(build, what: str, matches: Callable[[str], bool]) -> Path:
    """The one file of ``build`` (``delivery.serve.Build``) whose name ``matches``."""
    found = [f["name"] for f in build.files if matches(f["name"])]
    if len(found) != 1:
        raise EdgepathError(f"{build.root}: {build.tag}'s build ({build.path}) has {len(found)} {what}, not one")
    return build.root / found[0]


from . import executorch, gguf, unquantized, vllm_checkpoint  # noqa: E402  (each registers its family)

__all__ = ["QuantizedModel", "WeightPath", "executorch", "gguf", "of", "one_file", "register", "unquantized",
           "vllm_checkpoint"]
