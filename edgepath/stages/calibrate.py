"""The calibrate stage: what every build computes from the unquantized model, once.

Every quantize path and the phone's 4-bit export start from the same model and
the same text; before this stage each recomputed the same things. Lifecycle of
``run(model_dir, out, settings)``:

1. Refuse up front what cannot work: an output directory not this stage's own, a
   corrupt or truncated checkpoint or missing tokenizer (``hf_model.inspect``), a
   decoder GPTQ cannot order, a corpus too short or a chat template missing.
2. Draw the calibration windows (``text.calibration.calibration_set``) and the
   held-out windows of each genre (``held_out_genres``).
3. The reference: the unquantized model's perplexity on each genre's held-out
   windows, which every build's fidelity is an increase over.
4. The W4A8 ranking: each down projection by what rounding its input to int8 per
   token does to the model's output (``quant.activation_error``), on
   ``RANKING_SAMPLES`` calibration windows.
5. One forward of the calibration windows, layer by layer: the Hessian of every
   group of linears' shared input (``quant.sequential.input_hessians``), each
   layer's written to ``hessians/`` as soon as it is done
   (``quant.hessian_store``).
6. ``calibration.json``: the windows, the reference, the ranking, every Hessian
   file's sha256, and the stage's wall time and peak memory.

``OUT`` appears whole or not at all (``records.output_directory``). A reader
(``SharedCalibration``) refuses a record made from another model, and a Hessian
file whose sha256 is not the record's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from ..core import records, usage
from ..core.command import Command
from ..core.errors import EdgepathError
from ..formats import hf_model
from ..rules.fleet import Calibration, check_namespace

RECORD_NAME = records.FILE_NAMES["calibration"]
# Calibration samples the W4A8 ranking runs on, spread over the set: SmolLM2-135M's top four
# down projections were the same from 16 and from 32 samples (3 min on 2 cores for 16).
RANKING_SAMPLES = 16


@dataclasses.dataclass(frozen=True)
class Settings:
    """``params.yaml``'s ``calibration`` namespace and ``quantize.eval``."""

    calibration: Calibration = Calibration()
    eval_windows: int = 8
    """Held-out windows per genre (0: no perplexity measured). 8, not the benchmark's 16,
    to keep the quantize stage's time bounded: 8 x 512 tokens on each of five genres is
    already 2.5x the 16 x 512 of the single novel measured before."""
    eval_length: int = 512

    @classmethod
    def from_params(cls, calibration: dict[str, Any] | None = None, quantize: dict[str, Any] | None = None,
                    where: str = "params") -> "Settings":
        evaluation = check_namespace("quantize", dict(quantize or {}), where).get("eval") or {}
        return cls(Calibration.from_params(calibration, where),
                   **{f"eval_{k}": v for k, v in evaluation.items()})


def run(model_dir: str | Path, out: str | Path, settings: Settings = Settings()) -> dict[str, Any]:
    """Build ``out`` (module docstring); returns the record written there."""
    model_dir = Path(model_dir)
    out = records.check_output_directory(out, "calibration", sources=[model_dir])
    info = hf_model.inspect(model_dir, with_file_digests=False)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..quant import hessian_store
    from ..quant.activation_error import rank_down_projections
    from ..quant.sequential import check_architecture, input_hessians
    from ..text import calibration

    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"calibrate: {message}, {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = settings.calibration
    corpus = calibration.load_corpus(text.corpus, list(text.holdout))
    calib = calibration.calibration_set(tokenizer, corpus, text.samples, text.length, text.chat_fraction, text.seed)
    held_out = (calibration.held_out_genres(tokenizer, corpus, settings.eval_windows, settings.eval_length)
                if settings.eval_windows else {})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    check_architecture(model)

    from ..scoring.evaluate import perplexity_by_genre

    reference = perplexity_by_genre(model, held_out, lambda genre, ppl: progress(
        f"reference perplexity on held-out {genre}: {ppl:.2f}"))
    sample = calib.tokens[::max(1, len(calib.tokens) // RANKING_SAMPLES)][:RANKING_SAMPLES]
    ranked = rank_down_projections(model, sample)
    progress(f"down projections ranked by their int8 inputs' effect, first {ranked[0][0]}")

    with records.output_directory(out, "calibration", sources=[model_dir]) as scratch:
        folder = scratch / hessian_store.FOLDER
        folder.mkdir()
        stored = []
        layers = len(model.model.layers)
        for i, hessians in enumerate(input_hessians(model, calib.tokens)):
            layer = i if i < layers else None
            stored.append(hessian_store.write(folder, layer, hessians))
            progress(f"Hessians of layer {i + 1}/{layers}" if layer is not None else "Hessian of the output head")
        record = {
            **records.envelope("calibration"),
            "model": {"directory": str(model_dir.resolve()), "fingerprint": info["fingerprint"]},
            "calibration": calib.record,
            "reference": {"windows_per_genre": settings.eval_windows, "length": settings.eval_length,
                          "held_out": calibration.held_out_record(corpus) if held_out else None,
                          "tokens_sha256": {g: calibration.tokens_sha256(w) for g, w in held_out.items()},
                          "perplexity": reference},
            "down_proj_int8": {"samples": len(sample),
                               "ranking": [{"tensor": p, "kl_nats_per_token": round(kl, 6)} for p, kl in ranked]},
            "hessians": {"folder": hessian_store.FOLDER, "dtype": "float32", "tokens": calib.tokens.numel(),
                         "files": stored},
            "versions": records.versions("torch", "transformers", "safetensors"),
            **usage.cost(started),
        }
        records.write(scratch / RECORD_NAME, "calibration", record)
    return record


class SharedCalibration:
    """A calibrate stage's output, read by the builds: the record, checked to be of
    ``model_dir``'s model, and its Hessians (``hessians``, a ``quant.hessian_store``
    reader)."""

    def __init__(self, record_path: str | Path, fingerprint: str) -> None:
        path = Path(record_path)
        if path.is_dir():
            path = path / RECORD_NAME
        self.record = records.read(path, "calibration", missing="run the calibrate stage (edgepath calibrate)")
        if self.record["model"]["fingerprint"] != fingerprint:
            raise EdgepathError(f"{path}: calibrated another model (fingerprint "
                                f"{self.record['model']['fingerprint'][:19]}, this one {fingerprint[:19]}); "
                                "re-run the calibrate stage on this model")
        self.folder = path.parent / self.record["hessians"]["folder"]

    def check_held_out(self, digests: dict[str, str]) -> None:
        """Refuse held-out windows (genre -> sha256 of their ids) other than those the
        reference perplexities were measured on."""
        if digests != self.record["reference"]["tokens_sha256"]:
            raise EdgepathError(f"{self.folder.parent}: its reference perplexities were measured on other held-out "
                                "text than this build's (the corpus or its held-out documents changed); re-run "
                                "the calibrate stage")

    def check_calibration(self, record: dict[str, Any]) -> None:
        """Refuse calibration windows (``CalibrationSet.record``) other than those the
        Hessians were accumulated over."""
        if record["tokens_sha256"] != self.record["calibration"]["tokens_sha256"]:
            raise EdgepathError(f"{self.folder.parent}: calibrated on other windows than params.yaml's calibration "
                                "names now; re-run the calibrate stage")

    def hessians(self):
        from ..quant.hessian_store import HessianStore

        return HessianStore(self.folder, self.record["hessians"]["files"])

    def ranked_down_projections(self) -> list[tuple[str, float]]:
        return [(r["tensor"], r["kl_nats_per_token"]) for r in self.record["down_proj_int8"]["ranking"]]


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from ..rules import fleet

    model_dir = Path(args.model)
    if model_dir.is_file():  # a model record: calibrate on the directory it names
        model_dir = records.model_directory(model_dir, records.read(model_dir, "model"))
    given = Path(args.params).is_file()
    settings = Settings.from_params(fleet.namespace(args.params, "calibration") if given else {},
                                    fleet.namespace(args.params, "quantize") if given else {}, where=args.params)
    record = run(model_dir, args.out, settings)
    c = record["calibration"]
    print(f"calibrate: {c['samples']} x {c['length']} tokens, {len(record['hessians']['files'])} Hessian files "
          f"({sum(f['bytes'] for f in record['hessians']['files']) / 2**20:.0f} MiB), reference perplexity on "
          f"{len(record['reference']['perplexity'])} genres, {record['wall_time_s']:.0f} s, peak "
          f"{record['peak_rss_bytes'] / 2**30:.1f} GiB -> {Path(args.out) / RECORD_NAME}")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face directory, or a model record (model.json)")
    p.add_argument("--out", required=True, help="output directory (replaced atomically; only an earlier one of this "
                                                "stage)")
    p.add_argument("--params", default="params.yaml",
                   help="settings from its 'calibration' namespace and 'quantize.eval', if present")


COMMAND = Command("calibrate", "compute once what every build needs from the unquantized model", """\
    Run the unquantized model over the calibration text once, for every build:
    the Hessians of every linear's input (what GPTQ rounds against), the
    reference perplexity on each held-out genre, and the ranking of the down
    projections by what int8 inputs cost them (the W4A8 path's). The quantize
    stage and the phone's 4-bit export read OUT instead of each running the model.

    example:  edgepath calibrate --model build/model/model.json --out build/calibration""", _arguments, _cmd)
