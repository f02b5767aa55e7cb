"""One engine in its own process, driven by the benchmark over a pipe.

    python -m edgepath.engines.worker --engine vllm --model DIR [--quantization Q]
        [--env KEY=VALUE ...] --cache-dir DIR --threads N
    python -m edgepath.engines.worker --engine llama.cpp --model FILE.gguf --threads N

Every engine of a benchmark run stays up in its own worker, so measurements
interleave (A B A B ...) without restarting engines, and each engine's memory
is its process's own. The protocol is JSON lines: the worker writes
``{"ready": true, "info": {...}}`` once the engine is up, then answers each
request line on stdin with one line (or ``{"error": "..."}``):

- ``{"op": "decode", "prompt": [ids], "new_tokens": n}`` -> ``{"seconds_per_token": s}``
- ``{"op": "prefill", "prompt": [ids]}`` -> ``{"seconds": s}``
- ``{"op": "score", "sequences": [[ids]]}`` -> ``{"nll": [[...]], "top1": [[...]]}``
- ``{"op": "greedy", "prompts": [[ids]], "new_tokens": n}`` -> ``{"tokens": [[...]]}``
- ``{"op": "profile", "prompt": [ids], "new_tokens": n}`` -> ``{"wall_s": s, "ops": [...]}``
  (vLLM only: the PyTorch profiler's operators, ``VllmCpu.profile_decode``)

The answers go to the process's original stdout; everything the engines print
(vLLM logs to stdout) is redirected to stderr, so it cannot corrupt the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _engine(args: argparse.Namespace):
    if args.engine == "llama.cpp":
        from .llama_cpp import LlamaCpp

        return LlamaCpp(args.model, threads=args.threads)
    from .vllm_cpu import VllmCpu

    env = dict(item.split("=", 1) for item in args.env)
    w4a8 = env.pop("VLLM_CPU_INT4_W4A8", "0") == "1"
    return VllmCpu(args.model, args.quantization, w4a8=w4a8, enforce_eager=False,
                   compile_cache_dir=args.cache_dir, env=env, prefix_caching=False)


def _info(engine) -> dict[str, Any]:
    if hasattr(engine, "info"):
        return engine.info()
    from vllm.compilation.counter import compilation_counter

    return {"layer_modes": engine.layer_modes(), "aot_artifacts_loaded": compilation_counter.num_aot_artifacts_loaded}


def _answer(engine, request: dict[str, Any]) -> dict[str, Any]:
    op = request["op"]
    if op == "decode":
        return {"seconds_per_token": engine.decode_seconds_per_token(request["prompt"], request["new_tokens"])}
    if op == "prefill":
        return {"seconds": engine.prefill_seconds(request["prompt"])}
    if op == "score":
        return engine.score(request["sequences"])
    if op == "greedy":
        return {"tokens": engine.greedy(request["prompts"], request["new_tokens"])}
    if op == "profile" and hasattr(engine, "profile_decode"):
        return engine.profile_decode(request["prompt"], request["new_tokens"])
    raise ValueError(f"unknown op {op!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m edgepath.engines.worker")
    parser.add_argument("--engine", choices=("vllm", "llama.cpp"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the vLLM engine")
    parser.add_argument("--cache-dir", help="vLLM's compile cache directory (VLLM_CACHE_ROOT)")
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)

    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    engine = _engine(args)
    replies.write(json.dumps({"ready": True, "info": _info(engine)}) + "\n")
    for line in sys.stdin:
        try:
            reply = _answer(engine, json.loads(line))
        except Exception as e:  # noqa: BLE001 - reported to the driver, which fails the run naming it
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
