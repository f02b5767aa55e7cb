"""Serve a pulled build over an OpenAI-compatible HTTP API: ``edgepath serve DIR``.

Lifecycle of ``edgepath serve DIR [--host H] [--port P] [--parallel N] [--context T] [--engine-args=ARGS]``:

0. Check the address and the sizes (``check_listen``): the port in range and free,
   ``--parallel`` and ``--context`` in range.
1. Read what ``DIR`` holds: an ``edgepath pull`` receipt (``edgepath-pull.json``)
   or a device bundle's record (``edgepath-device.json``, ``build/devices/<tag>``).
   Either names the device's weight path and every file with its size and sha256,
   each inside ``DIR`` (the rule ``pull`` names files by).
2. Check every file against it: a missing, altered or extra file refuses ``DIR``,
   naming the file (an extra ``.safetensors`` beside the checkpoint would be loaded).
3. Plan the weight path's engine as a server (``server_command``):

   - a vLLM path: vLLM's own OpenAI server over the checkpoint's folder, with the
     path's engine arguments (``quantization``, ``dtype``) and environment
     (``VLLM_CPU_INT4_W4A8``, the switches of edgepath's plugin, which vLLM loads in
     its every process); a 4-bit path whose kernel this host's vLLM lacks is
     refused before anything starts;
   - a GGUF path: llama.cpp's ``llama-server``, built by set-up from the same
     sources as the benchmark's control, with ``--parallel`` slots and continuous
     batching;
   - a phone's ExecuTorch program is not served (it runs on the phone).

4. Replace this process with the server (signals reach it directly). The server
   answers ``/v1/chat/completions`` and ``/v1/completions`` under the device's tag
   as the model name, and ``/health``.

``--engine-args`` go to the server, split as a shell would (``--engine-args=--enforce-eager``
for vLLM, ``--engine-args="--log-disable --temp 0"`` for llama-server).

The client's side, for the tests and the serving benchmark: ``Server`` runs one
server process until its ``/health`` answers, and posts JSON to it.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import paths
from ..core import records
from ..core.command import Command
from ..core.errors import EdgepathError
from ..core.files import safe_relative, sha256_file
from ..rules import weight_paths
from ..rules.memory import DEFAULT_CONTEXT
from ..rules.versions import build_files

RECORDS = (records.FILE_NAMES["pull"], records.FILE_NAMES["device"])
"""The records a directory to serve holds one of: a pull's receipt, a bundle's record."""


@dataclass(frozen=True)
class Build:
    """One device's build on disk: its tag, weight path and files (relative to ``root``)."""

    root: Path
    tag: str
    path: str
    files: tuple[dict[str, Any], ...]
    """``{"name", "size", "sha256"}`` each; ``name`` relative to ``root``."""


def read_build(directory: str | os.PathLike) -> Build:
    """The build ``directory`` holds, as its record names it (its files not yet checked);
    a file named outside the directory (absolute, or through ``..``) is refused by the
    rule ``pull`` refuses it by (``files.safe_relative``)."""
    root = Path(directory)
    if not root.is_dir():
        raise EdgepathError(f"{root}: not a directory; serve the directory `edgepath pull` or the bundle stage wrote")
    receipt, device = (root / name for name in RECORDS)
    if receipt.exists():
        record = records.read(receipt, "pull")
        files = [{"name": safe_relative(f["path"], f"{receipt}: a file's path"), "size": f["size"],
                  "sha256": f["sha256"]} for f in record["files"]]
        return Build(root, record["tag"], record["path"]["name"], tuple(files))
    if device.exists():
        target = records.read(device, "device")["target"]
        files = [{"name": safe_relative(f["name"], f"{device}: a file's name"), "size": f["size"],
                  "sha256": f["sha256"]} for f in build_files(target)]
        return Build(root, target["tag"], target["path"]["name"], tuple(files))
    raise EdgepathError(f"{root}: holds neither {RECORDS[0]} nor {RECORDS[1]}; serve the directory "
                        f"`edgepath pull <tag> -o DIR` or the bundle stage wrote")


def check_files(build: Build) -> None:
    """Every file the record names, of its size and sha256, and no other file."""
    named = {f["name"] for f in build.files}
    for f in build.files:
        file = build.root / f["name"]
        if not file.is_file():
            raise EdgepathError(f"{file}: missing; the build's record names it (pull the build again)")
        size = file.stat().st_size
        sha = sha256_file(file) if size == f["size"] else None
        if (size, sha) != (f["size"], f["sha256"]):
            raise EdgepathError(f"{file}: altered: {size} bytes{', sha256 ' + sha if sha else ''}; the build's "
                                f"record says {f['size']} bytes, sha256 {f['sha256']} (pull the build again)")
    for file in sorted(build.root.rglob("*")):
        rel = file.relative_to(build.root).as_posix()
        if not file.is_dir() and rel not in named and rel not in RECORDS:
            raise EdgepathError(f"{file}: extra: not a file of the build its record names (an engine would read "
                                f"it beside the checkpoint); remove it")


def server_command(spec: weight_paths.WeightPathSpec, model: Path, name: str, host: str, port: int,
                   parallel: int, context: int, engine_args: list[str] = (),
                   environ: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the server for path ``spec`` over ``model`` (a vLLM
    checkpoint's folder, or a GGUF file), named ``name``: ``parallel`` sequences at
    once, each of up to ``context`` tokens (its family's ``server_command``)."""
    return paths.of(spec).server_command(model, name, host, port, parallel, context, list(engine_args),
                                         dict(os.environ if environ is None else environ))


# The most sequences a server decodes at once, and tokens per sequence: past these a
# number is a typo, not a plan (params.schema.json's target context has the same bound).
MAX_PARALLEL = 1024
MAX_CONTEXT = 1 << 20


def check_listen(host: str, port: int, parallel: int, context: int) -> None:
    """Refuse, before any engine starts, a port outside 1-65535 or in use on ``host``,
    and a ``parallel`` or ``context`` outside its range: an engine given them fails
    later, or (llama-server given a port past 65535) listens somewhere else."""
    for name, value, top in (("--port", port, 65535), ("--parallel", parallel, MAX_PARALLEL),
                             ("--context", context, MAX_CONTEXT)):
        if not 1 <= value <= top:
            raise EdgepathError(f"{name} {value}: out of range; give 1 to {top}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise EdgepathError(f"--host {host!r}: not an address this machine can listen on ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe_socket:
        probe_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers themselves bind
        try:
            probe_socket.bind(address)
        except OSError as e:
            raise EdgepathError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); "
                                f"{'another server holds the port: ' if e.errno == errno.EADDRINUSE else ''}"
                                f"give another --port or --host") from None


def plan(directory: str | os.PathLike, host: str, port: int, parallel: int, context: int,
         engine_args: list[str] = ()) -> tuple[Build, list[str], dict[str, str]]:
    """Steps 1-3 of the lifecycle: the checked build, and its server's argv and environment."""
    from ..stages.probe import probe

    check_listen(host, port, parallel, context)
    build = read_build(directory)
    spec = weight_paths.get(build.path)
    check_files(build)
    model = paths.of(spec).served_model(build, probe)
    argv, env = server_command(spec, model, build.tag, host, port, parallel, context, engine_args)
    return build, argv, env


# ---------------------------------------------------------------- the client's side

def free_port() -> int:
    """A TCP port nothing on this machine listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process (``argv``, ``env``: ``edgepath serve ...``, or a
    ``server_command``) listening on ``port`` of this machine, its output appended to
    ``log``. Entering waits until ``/health`` answers 200 (up to ``timeout`` seconds);
    a process that exits first, or does not answer in time, raises ``EdgepathError``
    with the end of its log. Leaving stops its whole process group (vLLM's engine core
    is a child): SIGTERM, then SIGKILL after 60 s."""

    def __init__(self, argv: list[str], env: dict[str, str] | None, port: int, log: str | os.PathLike,
                 timeout: float = 900) -> None:
        self.argv, self.env, self.log, self.timeout = argv, env, Path(log), timeout
        self.url = f"http://127.0.0.1:{port}"
        self.start_s: float | None = None
        """Seconds from spawning the process to its first healthy answer."""

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def __enter__(self) -> Server:
        started = time.perf_counter()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise EdgepathError(f"{self.argv[0]} exited ({self.proc.returncode}) before serving:\n{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or loading (llama-server answers 503)
            if time.perf_counter() - started > self.timeout:
                self.__exit__()
                raise EdgepathError(f"{self.argv[0]}: not serving after {self.timeout:.0f} s:\n{self._tail()}")
            time.sleep(0.5)
        self.start_s = time.perf_counter() - started
        return self

    def post(self, route: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        """POST ``body`` as JSON to ``route``; the JSON answer. An error status raises
        ``EdgepathError`` with the server's answer."""
        request = urllib.request.Request(self.url + route, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as e:
            raise EdgepathError(f"{self.url}{route}: {e.code} {e.read().decode(errors='replace')[:2000]}") from None

    def pause(self) -> None:
        """Stop the server's whole process group (SIGSTOP): while another server is
        measured, an idle one takes no CPU from it."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def __exit__(self, *exc: object) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a paused server would not act on SIGTERM
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            self.proc.wait()


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    build, argv, env = plan(args.dir, args.host, args.port, args.parallel, args.context, args.engine_args)
    print(f"serve {build.tag}: {build.path}, {len(build.files)} files, every sha256 as its record's; "
          f"http://{args.host}:{args.port}/v1 (model {build.tag!r})\n  {' '.join(argv)}", file=sys.stderr, flush=True)
    os.execve(argv[0], argv, env)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="a directory `edgepath pull` wrote, or a device bundle (build/devices/<tag>)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--parallel", type=int, default=4,
                   help="sequences decoded at once: llama-server's slots, vLLM's --max-num-seqs (default: 4)")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                   help=f"tokens per sequence, prompt and answer (default: {DEFAULT_CONTEXT}, the context the "
                        f"select stage counts a build's memory at)")
    p.add_argument("--engine-args", type=shlex.split, default="", metavar="ARGS",
                   help="more arguments for the server, split as a shell would: --engine-args=--enforce-eager")


COMMAND = Command("serve", "serve a pulled build over an OpenAI-compatible HTTP API", """\
    Start the engine a pulled build's record names as an OpenAI-compatible HTTP
    server: vLLM's own server with the weight path's quantization, environment and
    edgepath's plugin, or llama.cpp's llama-server for a GGUF build. Every file is
    checked against its sha256 first; a missing, altered or extra file refuses the
    directory. The model is served under the device's tag.

    examples: edgepath serve /opt/models/smollm2 --port 8000
              curl localhost:8000/v1/chat/completions -d '{"model": "host",
                   "messages": [{"role": "user", "content": "Hello"}]}'
              edgepath serve build/devices/gpu-cuda --engine-args=--enforce-eager""", _arguments, _cmd)
