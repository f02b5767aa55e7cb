"""The shared Hessians on disk: one safetensors file per decoder layer, and the head's.

Layout of the calibrate stage's ``hessians/`` folder:

- ``layer-000.safetensors``, ``layer-001.safetensors``, ...: one per decoder
  layer, a tensor per group of linears that read the same input, named by its
  first linear (``quant.sequential.shared_input``: ``model.layers.0.self_attn.q_proj``
  serves q/k/v, ``...o_proj``, ``...mlp.gate_proj`` serves gate/up,
  ``...mlp.down_proj``);
- ``head.safetensors``: ``lm_head``, the final norm's output.

Each tensor is ``[K, K]`` float32, ``2/n sum x x^T`` over the n calibration
tokens' inputs ``x [K]`` of the unquantized model. Accumulated in fp64
(``gptq.HessianAccumulator``), stored in fp32: GPTQ damps the diagonal by 1 % of
its mean before the Cholesky, far above fp32's relative rounding of 2^-24.

Every file is hashed when the store is opened, before any GPTQ runs, and again when
its layer is read: a truncated, corrupt or stale file is refused, never quantized
from, and refused before minutes of work that it would end.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from ..core.errors import EdgepathError
from ..core.files import sha256_file

FOLDER = "hessians"
HEAD_FILE = "head.safetensors"


def file_name(layer: int | None) -> str:
    """The file of decoder layer ``layer`` (None: the head)."""
    return HEAD_FILE if layer is None else f"layer-{layer:03d}.safetensors"


def write(folder: Path, layer: int | None, hessians: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write one layer's ``{key: H}`` (fp64) as float32 into ``folder`` (the stage's
    scratch directory, published whole); returns the record's entry for the file."""
    from safetensors.torch import save

    data = save({key: h.to(torch.float32).contiguous() for key, h in hessians.items()})
    (folder / file_name(layer)).write_bytes(data)
    return {"name": file_name(layer), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


class HessianStore:
    """``store(layer)`` -> that layer's ``{key: H}`` (fp64; None: the head's), read
    from ``folder`` once its file's sha256 matches ``files`` (the record's entries).
    Every file is checked when the store opens (missing, of another size, another
    sha256), before any GPTQ runs, and its sha256 again when its layer is read."""

    def __init__(self, folder: Path, files: list[dict[str, Any]]) -> None:
        self.folder = folder
        self.digests = {f["name"]: f["sha256"] for f in files}
        for f in files:
            path = folder / f["name"]
            if not path.is_file():
                raise EdgepathError(f"{path}: missing (re-run the calibrate stage)")
            if path.stat().st_size != f["bytes"]:
                raise EdgepathError(f"{path}: {path.stat().st_size} bytes, not the {f['bytes']} the calibration "
                                    "record names: truncated or from another run (re-run the calibrate stage)")
            self._check(path, sha256_file(path))

    def _check(self, path: Path, sha256: str) -> None:
        if sha256 != self.digests[path.name]:
            raise EdgepathError(f"{path}: its sha256 is not the one the calibration record names: the file is "
                                "corrupt, truncated or from another run (re-run the calibrate stage)")

    def __call__(self, layer: int | None) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        name = file_name(layer)
        path = self.folder / name
        if name not in self.digests:
            raise EdgepathError(f"{self.folder}: the calibration record names no {name}: the model has more "
                                "layers than were calibrated (re-run the calibrate stage)")
        if not path.is_file():
            raise EdgepathError(f"{path}: missing (re-run the calibrate stage)")
        data = path.read_bytes()
        self._check(path, hashlib.sha256(data).hexdigest())
        return {key: h.to(torch.float64) for key, h in load(data).items()}
