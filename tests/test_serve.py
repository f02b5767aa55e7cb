"""`edgepath serve`: what a directory must hold to be served, and the server each
weight path gets. The servers themselves answer chat requests in
tests/test_registry_e2e.py, on pulled builds."""

import hashlib
import sys
import time
from pathlib import Path

import pytest

from edgepath.cli import build_parser
from edgepath.core.errors import EdgepathError
from edgepath.delivery import serve
from edgepath.rules import weight_paths


def _build(root: Path, contents: dict[str, bytes]) -> serve.Build:
    for name, data in contents.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    files = tuple({"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in contents.items())
    return serve.Build(root, "host", "w4a16-tinygemm", files)


def test_a_directory_without_a_build_record_is_refused(tmp_path):
    with pytest.raises(EdgepathError, match="neither edgepath-pull.json nor edgepath-device.json"):
        serve.read_build(tmp_path)
    with pytest.raises(EdgepathError, match="not a directory"):
        serve.read_build(tmp_path / "missing")


def test_every_file_must_be_the_records(tmp_path):
    build = _build(tmp_path, {"w/config.json": b"{}", "w/model.safetensors": b"weights"})
    (tmp_path / serve.RECORDS[0]).write_text("{}")  # the record itself is not a build file
    serve.check_files(build)

    (tmp_path / "w" / "model.safetensors").write_bytes(b"weightz")
    with pytest.raises(EdgepathError, match=r"model.safetensors: altered: 7 bytes, sha256 [0-9a-f]{64}"):
        serve.check_files(build)
    (tmp_path / "w" / "model.safetensors").write_bytes(b"weights!")
    with pytest.raises(EdgepathError, match="altered: 8 bytes; the build's record says 7 bytes"):
        serve.check_files(build)
    (tmp_path / "w" / "model.safetensors").unlink()
    with pytest.raises(EdgepathError, match="model.safetensors: missing"):
        serve.check_files(build)

    (tmp_path / "w" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "w" / "model-00002.safetensors").write_bytes(b"more")
    with pytest.raises(EdgepathError, match="model-00002.safetensors: extra"):
        serve.check_files(build)


def test_a_gguf_build_gets_llama_server_with_a_slot_per_sequence(tmp_path):
    argv, env = serve.server_command(weight_paths.get("q4_0-gguf"), tmp_path / "m.gguf", "host", "127.0.0.1",
                                     8123, parallel=16, context=512, environ={"A": "1"})
    assert Path(argv[0]).name == "llama-server" and Path(argv[0]).is_file()
    flags = dict(zip(argv[1::2], argv[2::2]))
    assert flags["--model"] == str(tmp_path / "m.gguf") and flags["--alias"] == "host"
    assert flags["--parallel"] == "16" and flags["--ctx-size"] == str(16 * 512) and flags["--port"] == "8123"
    assert "--cont-batching" in argv and env == {"A": "1"}


@pytest.mark.parametrize("name", ["w4a8-gptq", "w4a16-tinygemm", "bf16"])
def test_a_vllm_build_gets_vllms_server_with_the_paths_arguments_and_environment(tmp_path, name):
    spec = weight_paths.get(name)
    user = {"OMP_NUM_THREADS": "7", "VLLM_CPU_INT4_W4A8": "0" if spec.w4a8 else "1", "HOME": "/h"}
    argv, env = serve.server_command(spec, tmp_path, "phone", "0.0.0.0", 9000, parallel=4, context=1024,
                                     engine_args=["--enforce-eager"], environ=user)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[-1] == "--enforce-eager"
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--model"] == str(tmp_path) and flags["--served-model-name"] == "phone"
    assert flags["--max-num-seqs"] == "4" and flags["--max-model-len"] == "1024"
    assert flags.get("--quantization") == spec.quantization
    assert flags["--dtype"] == (spec.dtype or "bfloat16")
    # the path's own environment wins over the user's; the user's thread count stays
    for key, value in spec.process_env().items():
        assert env[key] == value
    assert env["OMP_NUM_THREADS"] == "7" and env["HOME"] == "/h"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # the server keeps its engine core apart


@pytest.mark.parametrize("name", ["w8a16-qnn", "w4a8-xnnpack", "w8a8-xnnpack"])
def test_a_phone_program_is_not_served(tmp_path, name):
    with pytest.raises(EdgepathError, match="runs in the app on the phone, not as a server"):
        serve.server_command(weight_paths.get(name), tmp_path, "phone", "127.0.0.1", 1, 1, 1)


@pytest.mark.parametrize("argv, engine_args", [
    (["--engine-args=--enforce-eager"], ["--enforce-eager"]),
    (["--engine-args", "--enforce-eager --max-num-batched-tokens 64"],
     ["--enforce-eager", "--max-num-batched-tokens", "64"]),
    ([], [])])
def test_engine_arguments_are_split_as_a_shell_would(argv, engine_args):
    args = build_parser().parse_args(["serve", "d", "--port", "9", *argv])
    assert (args.dir, args.port, args.engine_args) == ("d", 9, engine_args)


_HEALTHY = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def _state(pid: int, wanted: str) -> str:
    """The process's state letter in /proc (T: stopped) once it is one of ``wanted``, or
    after 10 s (a signal is delivered asynchronously)."""
    deadline = time.monotonic() + 10
    while True:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in wanted or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


def test_a_server_runs_until_healthy_pauses_and_stops_even_when_paused(tmp_path):
    port = serve.free_port()
    with serve.Server([sys.executable, "-c", _HEALTHY, str(port)], None, port, tmp_path / "log", timeout=60) as s:
        assert s.start_s is not None and _state(s.proc.pid, "RS") in "RS"
        s.pause()
        assert _state(s.proc.pid, "T") == "T"
        s.resume()
        assert _state(s.proc.pid, "RS") in "RS"
        s.pause()  # left paused: leaving must still end it
    assert s.proc.returncode is not None


def test_a_server_that_exits_before_serving_raises_with_its_log(tmp_path):
    port = serve.free_port()
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(EdgepathError, match=r"exited \(3\) before serving:\n(.|\n)*no model here"):
        with serve.Server(argv, None, port, tmp_path / "log", timeout=60):
            pass
