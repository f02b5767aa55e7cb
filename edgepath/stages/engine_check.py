"""The ``check`` command: a 4-bit checkpoint in real vLLM against two references.

The check itself is the vLLM checkpoint family's (``paths.vllm_checkpoint.check``,
whose docstring says what it compares and why its pass marks are what they are); the
quantize stage runs it on every vLLM checkpoint it writes, and this command runs it
on any checkpoint folder.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from ..core import files, records
from ..core.command import Command, emit
from ..core.errors import EdgepathError
from ..rules.fleet import Calibration
from ..rules.weight_paths import vllm_kernel
from ..scoring.agreement import top1_against


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from ..paths.vllm_checkpoint import check, quant_method
    from ..text import calibration

    # every argument is read before anything loads (transformers alone takes seconds to
    # import): a wrong one is one line, not a model's or an engine's failure
    vllm_kernel(quant_method(files.path_of(args.checkpoint, "--checkpoint")), args.mode == "w4a8")
    files.read_json(files.path_of(args.model, "--model") / "config.json",
                    missing="--model: not a Hugging Face model directory")
    corpus = calibration.load_corpus(args.corpus, args.holdout)
    with tempfile.TemporaryDirectory(prefix="edgepath-check-") as scratch:
        # the engine's compiler caches in $TMPDIR/torchinductor_<user> by default: this
        # command leaves nothing behind
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", scratch)
        from transformers import AutoTokenizer

        from .probe import probe

        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint, local_files_only=True)
        sequences = calibration.check_sequences(tokenizer, corpus)
        checked = check(args.checkpoint, args.model, sequences, args.mode == "w4a8", probe(),
                        reference_checkpoint=args.reference_from)
    record = {**records.envelope("engine_check"), **checked}
    emit(records.dumps(record), args.out, "engine_check", record)
    if args.out and checked["not_run"]:
        print(f"check: not run: {checked['not_run']}")
    elif args.out:
        print(f"check: {checked['activation_mode']} on {checked['kernel_op']} (ran: {checked['ran_kernel']}), "
              f"top-1 vs dequantized {top1_against(checked, 'dequantized'):.3f}, "
              f"vs bf16 {top1_against(checked, 'bf16'):.3f} -> "
              f"{'passed' if checked['passed'] else 'FAILED'}")
    if not checked["passed"]:
        raise EdgepathError(f"the engine check did not run: {checked['not_run']}" if checked["not_run"]
                            else "the checkpoint failed its engine check (see the record)")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="the quantized directory")
    p.add_argument("--model", required=True, help="the unquantized Hugging Face directory it came from")
    p.add_argument("--mode", choices=("w4a8", "w4a16"), default="w4a8", help="VLLM_CPU_INT4_W4A8 on or off")
    p.add_argument("--corpus", default=Calibration.corpus,
                   help="the checkpoint's calibration corpus: the held-out text leaves out its calibration documents")
    p.add_argument("--holdout", nargs="*", default=list(Calibration.holdout),
                   help="the documents that calibration held out besides the corpus's own")
    p.add_argument("--reference-from", help="dequantize (a) from this checkpoint instead")
    p.add_argument("--out", help="write the record here (default: print it)")


COMMAND = Command("check", "check a 4-bit checkpoint in real vLLM", """\
    Load a 4-bit checkpoint in vLLM, record which kernel its layers ran, and compare
    the engine's teacher-forced predictions on held-out text of every genre with
    (a) the checkpoint's own weights dequantized in PyTorch and (b) the unquantized
    model.
    Exit status 2 when (a)'s agreement is under the mode's threshold.

    example:  edgepath check --checkpoint build/weights/PATH --model build/model/hf""", _arguments, _cmd)
