"""A real S3-compatible server on loopback for the tests: SeaweedFS (``weed``, Apache-2.0).

``deploy/seaweedfs/weed.sh fetch`` builds the pinned ``weed`` from the Go module proxy into
``.cache/seaweedfs/`` (``make test`` runs it first); the ``s3`` fixture (tests/conftest.py) starts one
server per pytest session on free loopback ports with a fresh data folder and an access key, and stops
it at the end. No mock: boto3 talks to the real server over HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from tests.api_support import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "seaweedfs" / "weed.sh"
ACCESS_KEY, SECRET_KEY = "dagfold-test", "dagfold-test-secret-key"


def weed_binary() -> Path:
    """The pinned ``weed``, built on first use (minutes on a fresh machine; cached after)."""
    out = subprocess.run([str(SCRIPT), "path"], capture_output=True, text=True, check=True).stdout.strip()
    path = Path(out)
    if not path.exists():
        subprocess.run([str(SCRIPT), "fetch"], check=True, timeout=3600)
    return path


class S3Server:
    """``weed server`` (master, volume, filer, S3 gateway) on loopback, in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, bucket: str, prefix: str = "") -> str:
        """The artifact URL (dagfold.artifacts.open_store) of a bucket on this server, created on first use."""
        return f"s3://{bucket}/{prefix}?endpoint={self.endpoint}&create=1"

    def start(self) -> S3Server:
        weed = weed_binary()
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "s3.json"
        conf.write_text(json.dumps({"identities": [{
            "name": "dagfold", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        ports = [free_port() for _ in range(6)]
        cmd = [str(weed), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={ports[0]}", f"-master.port.grpc={ports[1]}",
               f"-volume.port={ports[2]}", f"-volume.port.grpc={ports[3]}",
               "-filer", f"-filer.port={ports[4]}", f"-filer.port.grpc={ports[5]}",
               "-s3", f"-s3.port={self.port}", f"-s3.config={conf}", "-volume.max=0",
               "-master.volumeSizeLimitMB=64"]
        log = (self.workdir / "weed.log").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                              aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}; see {self.workdir / 'weed.log'}")
            try:
                client.create_bucket(Bucket="ready-check")
                client.put_object(Bucket="ready-check", Key="k", Body=b"ok")  # volumes are up too
                return
            except Exception as exc:  # not up yet
                last = exc
                time.sleep(0.5)
        raise RuntimeError(f"weed S3 not ready within {timeout_s}s: {last!r}")

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def set_env(server: S3Server) -> dict[str, str | None]:
    """Point boto3 at the server's credentials; returns the previous values."""
    old = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    return old
