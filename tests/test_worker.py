"""The engine-process protocol (``edgepath.engines.worker``) without a real engine:
the worker's own ``main`` runs in a fresh process over a stand-in engine, driven by
``EngineProcess`` exactly as patch-verify and the benchmark drive it."""

import json
import subprocess
import sys
import time

import pytest

from edgepath.core.errors import EdgepathError
from edgepath.engines import worker

# A worker whose engine is a stand-in: ``worker.main`` with ``_engine`` replaced. The
# stand-in echoes the parsed command line in its info, prints to stdout as vLLM does
# (which must not reach the protocol) and sleeps ``new_tokens`` seconds on "decode".
FAKE_WORKER = """
import sys, time
from edgepath.engines import worker

class Fake:
    def __init__(self, args):
        if args.model == "missing":
            raise FileNotFoundError("no model at missing")
        self.args = args
        print("engine log line on stdout", flush=True)

    def info(self):
        return {"aot_artifacts_loaded": 2, "args": {k: v for k, v in vars(self.args).items()}}

    def decode_seconds_per_token(self, prompt, new_tokens):
        time.sleep(new_tokens)
        return 0.01

    def greedy(self, prompts, new_tokens):
        print("more engine chatter", flush=True)
        return [[p[-1]] * new_tokens for p in prompts]

    def layer_modes(self):
        return [{"method": "Fake", "kernel": "fake::mm", "layers": 3}]

    def profiled_ops(self, prompts, new_tokens):
        return {"fake::mm", "aten::add"}

    def teacher_forced_top1(self, sequences):
        return [s[1:] for s in sequences]

    def plugin_status(self):
        return {"cpu_int4": {"state": "applied", "detail": "fake"}}

worker._engine = Fake
worker.main()
"""


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc), waiting up to a second for
    a signal just sent to take effect."""
    for _ in range(100):
        stopped = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T"
        if stopped:
            return True
        time.sleep(0.01)
    return False


def fake(cmd: list[str]) -> list[str]:
    """``cmd`` (``worker.command``) with the stand-in worker in place of the module."""
    assert cmd[:3] == [sys.executable, "-m", "edgepath.engines.worker"]
    return [sys.executable, "-c", FAKE_WORKER, *cmd[3:]]


def test_command_line():
    assert worker.command("llama.cpp", "m.gguf", threads=4) == [
        sys.executable, "-m", "edgepath.engines.worker", "--engine", "llama.cpp", "--model", "m.gguf",
        "--threads", "4"]
    assert worker.command("vllm", "dir", quantization="cpu_int4", cache_dir="c", prefix_caching=True,
                          env={"B": "2", "A": "1"}, engine_args={"max_num_seqs": 16, "block_size": 32})[3:] == [
        "--engine", "vllm", "--model", "dir", "--cache-dir", "c", "--env=A=1", "--env=B=2",
        "--quantization", "cpu_int4", "--prefix-caching", '--engine-args={"block_size": 32, "max_num_seqs": 16}']


def test_requests_are_answered_over_the_pipe(tmp_path):
    cmd = fake(worker.command("vllm", "dir", quantization="cpu_int4", cache_dir=tmp_path / "cache",
                              env={"VLLM_CPU_INT4_W4A8": "0", "EDGEPATH_FUSED_CPU_NORMS": "1"},
                              prefix_caching=True, engine_args={"compilation_config": {"custom_ops": ["+rms_norm"]}}))
    with worker.EngineProcess("fake", cmd, tmp_path / "log") as process:
        info = process.wait_ready(timeout=60)
        assert info["aot_artifacts_loaded"] == 2
        engine_args = info["args"].pop("engine_args")
        assert json.loads(engine_args) == {"compilation_config": {"custom_ops": ["+rms_norm"]}}
        assert info["args"] == {"engine": "vllm", "model": "dir", "quantization": "cpu_int4",
                                "env": ["EDGEPATH_FUSED_CPU_NORMS=1", "VLLM_CPU_INT4_W4A8=0"],
                                "cache_dir": str(tmp_path / "cache"), "prefix_caching": True, "threads": None}
        process.pause()  # stopped (state T) while another engine is timed, answering again once resumed
        assert _stopped(process.proc.pid)
        process.resume()
        assert process.ask("greedy", prompts=[[4]], new_tokens=1) == {"tokens": [[4]]}
        assert process.start_s >= process.engine_start_s >= 0
        assert process.ask("greedy", prompts=[[1, 2], [3]], new_tokens=2) == {"tokens": [[2, 2], [3, 3]]}
        assert process.ask("plugin_status") == {"cpu_int4": {"state": "applied", "detail": "fake"}}
        assert process.ask("measure", sequences=[[5, 6, 7]], prompts=[[1, 2], [3]], new_tokens=1) == {
            "layer_modes": [{"method": "Fake", "kernel": "fake::mm", "layers": 3}],
            "ops": ["aten::add", "fake::mm"], "top1": [[6, 7]], "greedy": [[2], [3]]}
        with pytest.raises(EdgepathError, match=r"^fake: ValueError: unknown op 'train'"):
            process.ask("train")
        assert process.ask("decode", prompt=[1], new_tokens=0) == {"seconds_per_token": 0.01}
    assert process.proc.returncode == 0  # closing stdin ends the worker
    log = (tmp_path / "log").read_text()
    assert "engine log line on stdout" in log and "more engine chatter" in log


def test_a_worker_that_does_not_answer_in_time_is_killed(tmp_path):
    process = worker.EngineProcess("fake", fake(worker.command("vllm", "dir")), tmp_path / "log")
    process.wait_ready(timeout=60)
    with pytest.raises(EdgepathError, match=r"fake: no answer to 'decode' within 0.5 s; the engine process was killed"):
        process.ask("decode", timeout=0.5, prompt=[1], new_tokens=30)
    assert process.proc.returncode is not None
    process.close()


def test_a_worker_that_cannot_start_says_why(tmp_path):
    process = worker.EngineProcess("fake", fake(worker.command("vllm", "missing")), tmp_path / "log")
    with pytest.raises(EdgepathError, match=r"fake: the engine process exited \(1\):[\s\S]*no model at missing"):
        process.wait_ready(timeout=60)
    process.close()


def test_the_real_worker_refuses_llama_cpp_without_threads(tmp_path):
    with worker.EngineProcess("w", worker.command("llama.cpp", "m.gguf"), tmp_path / "log") as process:
        with pytest.raises(EdgepathError, match=r"exited \(2\)[\s\S]*--engine llama.cpp needs --threads"):
            process.wait_ready(timeout=60)


def test_importing_the_driver_side_imports_no_engine():
    code = ("import sys, edgepath.engines.worker, edgepath.stages.benchmark, edgepath.stages.patch_verify; "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers', 'llama_cpp') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
