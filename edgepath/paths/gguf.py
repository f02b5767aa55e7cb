"""The GGUF family: ``q4_0-gguf``, GPTQ's weights in llama.cpp's Q4_0 blocks.

What the stages ask of it (``paths.WeightPath``):

- quantize: before GPTQ, the tensors the file stores above 4 bits (``TensorPolicy``,
  ``DEFAULT_POLICY``: the embedding, the output head, tied or not, and the key and
  value projections)
  are rounded to Q8_0 and kept out of GPTQ, so GPTQ and the report see the
  file's weights; then the file is written (``formats.gguf_file.write``, Q4_0 blocks
  from ``formats.gguf_q4_0_format``) and ``check``ed in llama.cpp against the same
  weights in PyTorch (``gguf_check.json``) before the folder is published.
- patch-verify: llama.cpp loads the GGUF; its teacher-forced top-1 must agree with
  the file's own weights read back by gguf-py (``formats.gguf_file.read_back``, an
  independent reader), and a copy with its nibbles swapped must fail the same check.
  llama.cpp runs unpatched on any CPU: no start is cached, no patch applies.
- benchmark: llama.cpp over the file, its bits as llama.cpp counts them.
- serve: ``llama-server`` over the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core import records
from ..core.errors import EdgepathError
from ..core.files import sha256_file
from ..rules.weight_paths import Engine, Stage
from ..scoring.agreement import TOP1, all_windows, top1_against
from . import QuantizedModel, WeightPath, one_file, register

# The agreement ``agreement`` must reach: llama.cpp rounds activations to 8 bits in its
# Q4_0 and Q8_0 dot products, PyTorch does not. Measured 0.95-0.98 per genre (GPTQ at
# group 32, Q8_0 embedding, SmolLM2-135M, 2 x 128 held-out tokens per genre, llama-cpp-
# python 0.3.36 on a Zen 4 host); a file with its nibbles swapped scores far below.
AGREEMENT_PASS = 0.90
FILE_NAME = "model.gguf"
EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"  # a head the model does not tie to its embedding table
EMBEDDING_TYPES = ("Q8_0", "F16", "F32")
# A Q8_0 block: 32 int8 codes and an fp16 scale, 34 bytes per 32 weights.
Q8_0_BITS = 8.5
REFERENCE_IS = ("the GPTQ weights the file holds, dequantized, in PyTorch fp32, with the tensors it stores above "
                "4 bits rounded as it stores them (the quantization report's tensor_policy)")
READ_BACK_IS = "the file's own tensors, dequantized by gguf-py, in PyTorch fp32 (formats.gguf_file.read_back)"
# A decoder matrix's GGUF name (llama.cpp's, by layer) and its Hugging Face module in the layer.
MATRICES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}
_DECODER_MATRIX = re.compile(rf"blk\.(\d+)\.({'|'.join(MATRICES)})\.weight")


def more_bits_layer(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits`` (src/llama-quant.cpp): the first and last eighth of
    the layers and every third between, where its Q4_K_M gives attn_v and ffn_down 6
    bits or more (Q8_0 for attn_v on SmolLM2's 576-wide rows: layers 0-2, 5, 8, ..., 23, 26-29)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


@dataclasses.dataclass(frozen=True)
class TensorPolicy:
    """Which GGUF type each tensor gets (module docstring, step 3): the per-tensor
    policy, kept apart from the numeric packing."""

    embedding: str = "Q8_0"
    """The embedding table and the output head, tied or not: llama.cpp's own choice for
    Q4_0 files on rows not a multiple of 256. On wider rows llama.cpp stores the head as
    Q6_K, which gguf-py cannot quantize; Q8_0 is exact in both and 2 bits wider."""
    q8_0: tuple[str, ...] = ()
    """Decoder matrices (``MATRICES`` keys) stored as Q8_0 rather than GPTQ's Q4_0, in the
    layers ``q8_0_layers`` names: GPTQ leaves them alone and they are rounded to Q8_0."""
    q8_0_layers: str = "more-bits"
    """``more-bits``: llama.cpp's ``more_bits_layer``s; ``all``: every layer."""

    def __post_init__(self):
        if self.embedding not in EMBEDDING_TYPES:
            raise EdgepathError(f"embedding type {self.embedding!r}: one of {', '.join(EMBEDDING_TYPES)}")
        unknown = set(self.q8_0) - set(MATRICES)
        if unknown or self.q8_0_layers not in ("more-bits", "all"):
            raise EdgepathError(f"Q8_0 matrices {sorted(unknown)} in {self.q8_0_layers!r} layers: matrices are "
                                f"{', '.join(MATRICES)}; layers 'more-bits' or 'all'")

    def _at_q8_0(self, matrix: str, layer: int, layers: int) -> bool:
        return matrix in self.q8_0 and (self.q8_0_layers == "all" or more_bits_layer(layer, layers))

    def type_of(self, name: str, shape: Sequence[int], layers: int) -> str:
        """The GGUF type of tensor ``name`` in a file of ``layers`` decoder layers."""
        if matrix := _DECODER_MATRIX.fullmatch(name):
            return "Q8_0" if self._at_q8_0(matrix[2], int(matrix[1]), layers) else "Q4_0"
        if name in (EMBEDDING, OUTPUT):
            return self.embedding
        if len(shape) == 1:  # norms and biases
            return "F32"
        raise EdgepathError(f"{name} {tuple(shape)}: no type policy for this tensor (an architecture the Q4_0 "
                            f"path does not know)")

    def kept_from_gptq(self, layers: int) -> list[str]:
        """The Hugging Face prefixes (``model.layers.N.<module>``) of the matrices stored as
        Q8_0, which GPTQ leaves unquantized."""
        return [f"model.layers.{i}.{MATRICES[m]}" for i in range(layers) for m in MATRICES
                if self._at_q8_0(m, i, layers)]

    def round_to_stored(self, model):
        """``model`` (PyTorch) with its embedding table, its head (where not tied to the
        table) and its Q8_0 matrices rounded as ``write`` stores them; done before GPTQ,
        so that GPTQ calibrates on them and the result is what the GGUF must reproduce."""
        import torch

        from ..formats import gguf_file

        table, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        rounded = [(table, self.embedding)] + ([(head, self.embedding)] if head is not table else [])
        layers = model.config.num_hidden_layers
        rounded += [(model.get_submodule(p).weight, "Q8_0") for p in self.kept_from_gptq(layers)]
        with torch.no_grad():
            for weight, kind in rounded:
                weight.copy_(torch.from_numpy(gguf_file.rounded(weight.detach().float().numpy(), kind)))
        return model


# The key and value projections at Q8_0 in every layer. On SmolLM2-135M (3 KV heads of 64
# on 576-wide rows) they are 6 % of the decoder's weights; screened on one GPTQ build
# (benchmarks/gguf_mix.py, 8 x 512 held-out tokens per genre, Zen 4 host) they took the mean
# perplexity increase over bf16 from +6.96 % to +3.96 % for 0.20 more bits per weight (5.55,
# against Q4_K_M's 6.17 at +5.83 %), below Q4_K_M on every genre, where Q4_K_M's own choice
# (attn_v and ffn_down in its more-bits layers) reached +5.06 % at 5.76.
DEFAULT_POLICY = TensorPolicy(q8_0=("attn_k", "attn_v"), q8_0_layers="all")
DEFAULT_POLICY_REASON = ("attn_k and attn_v at Q8_0 in every layer: 6 % of SmolLM2-135M's decoder weights, they "
                         "took the held-out perplexity increase from +6.96 % to +3.96 % for 0.20 more bits per "
                         "weight, below llama.cpp Q4_K_M on every genre (benchmarks/gguf_mix.py)")


def agreement(gguf: str | os.PathLike, reference, sequences: dict[str, list[list[int]]],
              threads: int) -> tuple[float, dict[str, float]]:
    """(over every position, per genre) the share of positions where llama.cpp's top-1
    on ``gguf`` equals PyTorch's on ``reference``, teacher-forced over ``sequences``
    (genre -> windows of token ids, each genre's of one length)."""
    with _loaded(gguf, sequences, threads) as engine:
        return top1_agreement(engine.score(all_windows(sequences))["top1"], reference, sequences)


@contextlib.contextmanager
def _loaded(gguf: str | os.PathLike, sequences: dict[str, list[list[int]]], threads: int):
    from ..engines.llama_cpp import LlamaCpp

    engine = LlamaCpp(gguf, threads=threads, n_ctx=max(64, max(len(w) for ws in sequences.values() for w in ws)))
    try:
        yield engine
    finally:
        engine.close()


def top1_agreement(engine_top1: list[list[int]], reference,
                   sequences: dict[str, list[list[int]]]) -> tuple[float, dict[str, float]]:
    """``agreement``'s figures from llama.cpp's top-1 already scored (one list per window
    of ``scoring.agreement.all_windows(sequences)``, in that order) against ``reference``'s."""
    import torch

    from ..scoring.agreement import agreement as share_agreeing
    from ..scoring.agreement import agreement_by_genre

    with torch.no_grad():
        torch_top1 = [row for ws in sequences.values()
                      for row in reference(torch.tensor(ws)).logits[:, :-1].argmax(dim=-1).tolist()]
    return share_agreeing(engine_top1, torch_top1), agreement_by_genre(engine_top1, torch_top1, sequences)


def check(gguf: str | os.PathLike, reference, reference_is: str, sequences: dict[str, list[list[int]]],
          threads: int) -> dict[str, Any]:
    """The GGUF check record (``gguf_check.schema.json``): the file as llama.cpp loads it
    (size, sha256, bits per weight as llama.cpp counts them, tensor types) and its
    ``agreement`` with ``reference`` (described by ``reference_is``), passed at
    ``AGREEMENT_PASS``."""

    from ..formats.gguf_file import gguf_module
    from ..scoring.agreement import comparison

    gguf = Path(gguf)
    with _loaded(gguf, sequences, threads) as engine:
        info = engine.info()
        overall, by_genre = top1_agreement(engine.score(all_windows(sequences))["top1"], reference, sequences)
    types: dict[str, int] = {}
    for tensor in gguf_module().GGUFReader(gguf).tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return {
        **records.envelope("gguf_check"),
        "engine": records.tool("llama-cpp-python"),
        "file": {"name": gguf.name, "size": gguf.stat().st_size, "sha256": sha256_file(gguf),
                 "bits_per_weight": info["bits_per_weight"], "parameters": info["parameters"],
                 "tensor_types": dict(sorted(types.items())), "desc": info["desc"]},
        "reference": reference_is,
        "held_out": {"windows_per_genre": {g: len(ws) for g, ws in sequences.items()},
                     "length": max(len(w) for ws in sequences.values() for w in ws)},
        "teacher_forced_positions": sum(len(w) - 1 for ws in sequences.values() for w in ws),
        "against": {"reference": comparison(overall, by_genre)},
        "threshold": {"teacher_forced_top1_vs_reference": AGREEMENT_PASS},
        "passed": overall >= AGREEMENT_PASS,
    }


@register
class GgufQ4_0Path(WeightPath):
    """``q4_0-gguf`` (module docstring)."""

    engine = Engine.LLAMA_CPP
    built_by = Stage.QUANTIZE
    check_kind = "gguf_check"

    def refuse(self, settings) -> None:
        if settings.head != "bf16":
            raise EdgepathError(f"quantize.head {settings.head!r}: {self.spec.name}'s GGUF stores the output head "
                                f"as Q8_0, as it stores the embedding table; the head setting 'int4' is for vLLM "
                                f"paths")

    def before_gptq(self, model, shared, settings, started: float) -> tuple[list[str], dict[str, Any]]:
        DEFAULT_POLICY.round_to_stored(model)
        return DEFAULT_POLICY.kept_from_gptq(model.config.num_hidden_layers), {}

    def head_record(self, settings) -> dict[str, Any]:
        return {"stored": "q8_0", "tied_embedding_kept": "q8_0"}

    def publish(self, built: QuantizedModel, report: dict[str, Any], settings, out: Path) -> None:
        """The GGUF of GPTQ's blocks (``formats.gguf_file.write``), checked in llama.cpp
        against ``built.model`` (the same weights in PyTorch) before ``out`` is published."""
        from ..formats import gguf_file

        model, policy = built.model, DEFAULT_POLICY
        report["tensor_policy"] = {"embedding": policy.embedding, "q8_0": list(policy.q8_0),
                                   "q8_0_layers": policy.q8_0_layers, "q8_0_tensors": built.kept,
                                   "reason": DEFAULT_POLICY_REASON}
        q4_0 = sum(q.codes.numel() for q in built.layers.values())
        q8_0 = sum(model.get_submodule(p).weight.numel() for p in built.kept)
        report["bits_per_weight"] = round((q4_0 * self.spec.bits_per_weight(built.group) + q8_0 * Q8_0_BITS)
                                          / (q4_0 + q8_0), 4)
        report_name = records.FILE_NAMES["quantization"]
        records.validate("quantization", report, where=str(out / report_name))
        with records.output_directory(out, "quantization", sources=[built.model_dir]) as scratch:
            with tempfile.TemporaryDirectory(dir=scratch, prefix=".hf-") as hf:
                gguf_file.write(gguf_file.save_dequantized(model, built.model_dir, hf), scratch / FILE_NAME,
                                policy.type_of)
            (scratch / report_name).write_text(records.dumps(report))
            print("quantize: checking the GGUF in llama.cpp against the same weights in PyTorch",
                  file=sys.stderr, flush=True)
            checked = check(scratch / FILE_NAME, model, REFERENCE_IS, built.check_sequences,
                            threads=os.cpu_count() or 1)
            records.write(scratch / records.FILE_NAMES[self.check_kind], self.check_kind, checked)
            if not checked["passed"]:
                agreement = top1_against(checked, "reference")
                raise EdgepathError(f"llama.cpp's output disagrees with the GPTQ weights it was written from: top-1 "
                                    f"agreement {agreement:.3f} < {AGREEMENT_PASS} (a packing or tensor-order "
                                    f"mistake); the GGUF was not written")

    def check_line(self, out: Path) -> str:
        check = records.read(out / records.FILE_NAMES[self.check_kind], self.check_kind)
        return f"llama.cpp check passed (top-1 agreement {top1_against(check, 'reference'):.3f})"

    def verify(self, artifact: Path, model_dir: Path, host, corpus: str,
               holdout: tuple[str, ...]) -> dict[str, Any]:
        """llama.cpp against the file's own weights read back, and a copy with its
        nibbles swapped that must fail (module docstring)."""
        from transformers import AutoTokenizer

        from ..formats import gguf_file
        from ..text import calibration

        gguf = artifact / FILE_NAME
        if not gguf.is_file():
            raise EdgepathError(f"{gguf}: no GGUF: has quantize@{self.spec.name} run?")
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        sequences = calibration.check_sequences(tokenizer, calibration.load_corpus(corpus, list(holdout)))
        reference = gguf_file.read_back(gguf, model_dir)
        threads = os.cpu_count() or 1
        checked = check(gguf, reference, READ_BACK_IS, sequences, threads)
        with tempfile.TemporaryDirectory(prefix="edgepath-verify-") as scratch:
            swapped, _ = agreement(gguf_file.swap_nibbles(gguf, Path(scratch) / "swapped.gguf"),
                                   reference, sequences, threads)
        overall = top1_against(checked, "reference")
        failures = []
        if not checked["passed"]:
            failures.append(f"llama.cpp's top-1 agreement with the file's own weights {overall:.3f} is under "
                            f"{AGREEMENT_PASS}")
        if swapped >= AGREEMENT_PASS:
            failures.append(f"a copy with its nibbles swapped scored {swapped:.3f}, not under {AGREEMENT_PASS}: "
                            f"the check cannot see a packing mistake")
        return {
            **records.envelope("patch_verify"), "path": self.spec.name, "artifact": str(artifact),
            "host": {"digest": host.digest(), "summary": host.summary()}, "engine": self.engine.value,
            "engine_kwargs": {}, "engine_env": {}, "not_run": None, "starts": None, "patches": {},
            "check": {**{k: v for k, v in checked.items() if k not in ("kind", "schema_version")},
                      "swapped_nibbles": {TOP1: round(swapped, 4), "failed": swapped < AGREEMENT_PASS}},
            "passed": not failures, "failures": failures,
        }

    def verify_line(self, record: dict[str, Any]) -> str:
        check = record["check"]
        return (f"llama.cpp top-1 agreement with the file's own weights {top1_against(check, 'reference'):.3f}, "
                f"its nibbles swapped {check['swapped_nibbles'][TOP1]:.3f}")

    def check_summary(self, check: dict[str, Any]) -> dict[str, Any]:
        """The ``gguf_check`` record in the fields of a vLLM engine check: llama.cpp runs the
        file's own kernels (there is no op to name), against the weights it was written from."""
        return {"passed": check["passed"], "engine": check["engine"],
                "activation_mode": "Q8_0 blocks (llama.cpp rounds activations for its Q4_0 and Q8_0 dot products)",
                "kernel_op": None, "ran_kernel": True, "not_run": None,
                "top1_vs_dequantized": top1_against(check, "reference"),
                "top1_vs_bf16": None, "note": f"against {check['reference']}"}

    def verified_detail(self, record: dict[str, Any], where: str) -> str:
        check = record["check"]
        return (f"patch-verify {where}: {check['engine']} ran the GGUF, teacher-forced top-1 agreement with "
                f"{check['reference']} {top1_against(check, 'reference'):.3f}; a copy with its nibbles swapped "
                f"scored {check['swapped_nibbles'][TOP1]:.3f}")

    def benchmark_arm(self, artifact: Path, parameters: int, name: str | None = None, role: str = "build"):
        """llama.cpp over the file; its bits as llama.cpp counts them, like the controls'
        (its check loaded the file)."""
        from ..engines.worker import Arm

        stored = records.read(artifact / records.FILE_NAMES[self.check_kind], self.check_kind)["file"]
        return Arm(name or self.spec.name, role, self.engine.value, artifact / stored["name"],
                   bits_per_weight=stored["bits_per_weight"],
                   bytes_per_token=round(stored["bits_per_weight"] * stored["parameters"] / 8))

    def served_model(self, build, host) -> Path:
        return one_file(build, "GGUF files", lambda n: n.endswith(".gguf"))

    def server_command(self, model: Path, name: str, host: str, port: int, parallel: int, context: int,
                       engine_args: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """``llama-server`` over the file; ``-c`` is the KV cache of all slots together, so
        each of the ``parallel`` slots gets ``context``."""
        from ..engines import llama_cpp, vllm_cpu

        threads = vllm_cpu.ENGINE_ENV["OMP_NUM_THREADS"]  # every CPU this process may run on
        argv = [str(llama_cpp.tool("llama-server")), "--model", str(model), "--alias", name, "--host", host,
                "--port", str(port), "--threads", threads, "--threads-batch", threads, "--parallel", str(parallel),
                "--ctx-size", str(context * parallel), "--cont-batching", "--jinja", "--no-webui"]
        return argv + list(engine_args), environ
