"""One engine in its own process, driven over a pipe: the one engine-process protocol
of edgepath (the benchmark and patch-verify stages both start their engines so).

    python -m edgepath.engines.worker --engine vllm --model DIR [--quantization Q]
        [--env KEY=VALUE ...] [--engine-args JSON] --cache-dir DIR [--prefix-caching] [--threads N]
    python -m edgepath.engines.worker --engine llama.cpp --model FILE.gguf --threads N

Both sides live here: ``main`` is the worker, ``EngineProcess`` (with
``command``, its command line) the driver's side. Every engine of a benchmark
run stays up in its own worker, so measurements interleave (A B A B ...)
without restarting engines, and each engine's memory is its process's own;
patch-verify starts its engine twice on one compile cache (cold, then warm).

vLLM's environment: ``VLLM_CPU_INT4_W4A8`` in ``--env`` is the activation mode
(default ``0``), the rest of ``--env`` is set in the process's environment
over ``VllmCpu``'s defaults (threads: ``OMP_NUM_THREADS``,
``VLLM_CPU_OMP_THREADS_BIND``), ``--cache-dir`` is ``VLLM_CACHE_ROOT``; the
engine is compiled (not eager), and its prefix cache is off unless
``--prefix-caching`` (a timed prompt would be served from it); ``--engine-args``
is a JSON object of more ``vllm.LLM`` keyword arguments, over those.

The protocol is JSON lines: the worker writes ``{"ready": true, "start_s": s,
"info": {...}}`` once the engine is up (``start_s``: seconds the engine took to
construct, in the worker; ``info``: for vLLM the quantized layers' modes and
``aot_artifacts_loaded``, vLLM's count of compiled artifacts loaded from the
compile cache; for llama.cpp ``LlamaCpp.info``), then answers each request
line on stdin with one line (or ``{"error": "..."}``):

- ``{"op": "decode", "prompt": [ids], "new_tokens": n}`` -> ``{"seconds_per_token": s}``
- ``{"op": "prefill", "prompt": [ids]}`` -> ``{"seconds": s}``
- ``{"op": "score", "sequences": [[ids]]}`` -> ``{"nll": [[...]], "top1": [[...]]}``
- ``{"op": "greedy", "prompts": [[ids]], "new_tokens": n}`` -> ``{"tokens": [[...]]}``
- ``{"op": "profile", "prompt": [ids], "new_tokens": n}`` -> ``{"wall_s": s, "ops": [...]}``
  (vLLM only: the PyTorch profiler's operators, ``VllmCpu.profile_decode``)
- ``{"op": "plugin_status"}`` -> edgepath's vLLM plugin as the engine core sees it
  (vLLM only: ``vllm_plugin.status()``)
- ``{"op": "measure", "sequences": [[ids]], "prompts": [[ids]], "new_tokens": n}``
  -> ``{"layer_modes": [...], "ops": [...], "top1": [[...]], "greedy": [[...]]}``
  (vLLM only: ``vllm_cpu.measure``, what the engine check records)

The worker exits when its stdin closes.

The answers go to the process's original stdout; everything the engines print
(vLLM logs to stdout) is redirected to stderr, so it cannot corrupt the protocol.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..core.errors import EdgepathError


def _engine(args: argparse.Namespace):
    if args.engine == "llama.cpp":
        from .llama_cpp import LlamaCpp

        return LlamaCpp(args.model, threads=args.threads)
    from .vllm_cpu import VllmCpu

    env = dict(item.split("=", 1) for item in args.env)
    w4a8 = env.pop("VLLM_CPU_INT4_W4A8", "0") == "1"
    return VllmCpu(args.model, args.quantization, w4a8=w4a8, enforce_eager=False,
                   compile_cache_dir=args.cache_dir, env=env, prefix_caching=args.prefix_caching,
                   engine_args=json.loads(args.engine_args))


def _info(engine) -> dict[str, Any]:
    if hasattr(engine, "info"):
        return engine.info()
    from vllm.compilation.counter import compilation_counter

    return {"layer_modes": engine.layer_modes(), "aot_artifacts_loaded": compilation_counter.num_aot_artifacts_loaded,
            "w4a8_gate_lifted": engine.w4a8_gate_lifted}


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
    if op == "plugin_status" and hasattr(engine, "plugin_status"):
        return engine.plugin_status()
    if op == "measure" and hasattr(engine, "profiled_ops"):
        from .vllm_cpu import measure

        return measure(engine, request["sequences"], request["prompts"], request["new_tokens"])
    raise ValueError(f"unknown op {op!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m edgepath.engines.worker")
    parser.add_argument("--engine", choices=("vllm", "llama.cpp"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the vLLM engine")
    parser.add_argument("--cache-dir", help="vLLM's compile cache directory (VLLM_CACHE_ROOT)")
    parser.add_argument("--prefix-caching", action="store_true", help="keep vLLM's prefix cache on")
    parser.add_argument("--engine-args", default="{}", help="a JSON object of more vllm.LLM keyword arguments")
    parser.add_argument("--threads", type=int,
                        help="engine threads (required by llama.cpp; vLLM's come from --env, module docstring)")
    args = parser.parse_args(argv)
    if args.engine == "llama.cpp" and args.threads is None:
        parser.error("--engine llama.cpp needs --threads")

    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    started = time.perf_counter()
    engine = _engine(args)
    start_s = time.perf_counter() - started
    replies.write(json.dumps({"ready": True, "start_s": start_s, "info": _info(engine)}) + "\n")
    for line in sys.stdin:
        try:
            reply = _answer(engine, json.loads(line))
        except Exception as e:  # noqa: BLE001 - reported to the driver, which fails the run naming it
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")


# ---------------------------------------------------------------- the driver's side

def command(engine: str, model: str | os.PathLike, *, threads: int | None = None, quantization: str | None = None,
            env: dict[str, str] | None = None, cache_dir: str | os.PathLike | None = None,
            prefix_caching: bool = False, engine_args: dict[str, Any] | None = None) -> list[str]:
    """The command line of a worker (module docstring) in this interpreter."""
    cmd = [sys.executable, "-m", "edgepath.engines.worker", "--engine", engine, "--model", str(model)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir)]
    cmd += [f"--env={k}={v}" for k, v in sorted((env or {}).items())]
    if quantization:
        cmd += ["--quantization", quantization]
    if prefix_caching:
        cmd.append("--prefix-caching")
    if engine_args:
        cmd.append(f"--engine-args={json.dumps(engine_args, sort_keys=True)}")
    return cmd


@dataclasses.dataclass(frozen=True)
class Arm:
    """One engine over one model file: a build (a weight path) or a control."""

    name: str
    role: str  # "build" | "control"
    engine: str  # "vllm" | "llama.cpp"
    model: Path
    quantization: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    bits_per_weight: float | None = None
    """Tensor bytes x 8 / the model's parameters (llama.cpp's count, for every arm)."""
    bytes_per_token: int | None = None
    """Weight bytes one decode step reads."""

    def command(self, cache_dir: Path, threads: int) -> list[str]:
        """This arm's worker (``engines.worker``); vLLM's ``threads`` are set in its
        environment, bound to the first ``threads`` cores."""
        if self.engine != "vllm":
            return command(self.engine, self.model, threads=threads)
        env = {**dict(self.env), "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
        return command(self.engine, self.model, threads=threads, quantization=self.quantization, env=env,
                              cache_dir=cache_dir)


class EngineProcess:
    """The driver's side of one worker: ``cmd`` (``command``) is spawned at once, its
    stderr (the engine's logs) appended to ``log``; ``name`` labels every error.
    ``wait_ready`` waits for the engine, ``ask`` sends a request and returns its
    answer, ``close`` ends the process (also on leaving a ``with`` block). A worker
    that exits, answers with an error or (given a ``timeout``, in seconds) does not
    answer in time raises ``EdgepathError`` with the end of its log; one that timed
    out is killed. Nothing heavy is imported here: the engine lives in the worker."""

    def __init__(self, name: str, cmd: list[str], log: str | os.PathLike) -> None:
        self.name, self.log = name, Path(log)
        self.start_s: float | None = None
        """Seconds from spawning the process to the engine's ready line."""
        self.engine_start_s: float | None = None
        """Seconds the engine took to construct, measured in the worker."""
        self.info: dict[str, Any] = {}
        self._spawned = time.perf_counter()
        with open(self.log, "ab") as stderr:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                         text=True)
        # a reader thread, so that waiting for a line can time out
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, name=f"engine-process-{self.proc.pid}", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")  # end of file: the process exited

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def _reply(self, what: str, timeout: float | None) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            self.proc.wait()
            raise EdgepathError(f"{self.name}: no answer to {what} within {timeout} s; the engine process was "
                                f"killed:\n{self._tail()}") from None
        if not line:
            self.proc.wait()
            raise EdgepathError(f"{self.name}: the engine process exited ({self.proc.returncode}):\n{self._tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise EdgepathError(f"{self.name}: {reply['error']}")
        return reply

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the engine to be up; returns its ``info`` (module docstring)."""
        ready = self._reply("the start", timeout)
        self.start_s = time.perf_counter() - self._spawned
        self.engine_start_s, self.info = ready["start_s"], ready["info"]
        return self.info

    def ask(self, op: str, timeout: float | None = None, **request: Any) -> dict[str, Any]:
        """Request ``op`` with ``request``'s fields (module docstring); its answer."""
        try:
            self.proc.stdin.write(json.dumps({"op": op, **request}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the process is gone: reading its answer says how it ended
        return self._reply(f"{op!r}", timeout)

    def pause(self) -> None:
        """Stop the worker (SIGSTOP) while another engine is timed (``benchmark.alone``)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """Close the worker's stdin (it exits) and wait for it: a minute, then kill it."""
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    main()
