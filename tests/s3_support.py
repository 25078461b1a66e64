"""A real S3-compatible server on loopback for the tests: S3Proxy (gaul/s3proxy, Apache-2.0) over a
folder (jclouds ``filesystem`` provider), started as a Java process.

``deploy/s3proxy/s3proxy.sh fetch`` puts the pinned jar into ``.cache/m2`` (``make test`` runs it
first; the fixture fetches it when missing); the ``s3`` fixture (tests/conftest.py) starts one server
per pytest session on a free loopback port with a fresh folder and an access key, and stops it at the
end. No mock: boto3 speaks S3 (signature v4, multipart, presigned URLs) to the real server over HTTP.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from tests.api_support import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "s3proxy" / "s3proxy.sh"
ACCESS_KEY, SECRET_KEY = "dagfold-test", "dagfold-test-secret-key"


def s3proxy_jar() -> Path:
    """The pinned S3Proxy jar, fetched on first use."""
    subprocess.run([str(SCRIPT), "fetch"], check=True, timeout=600)
    return Path(subprocess.run([str(SCRIPT), "path"], capture_output=True, text=True, check=True).stdout.strip())


class S3Server:
    """S3Proxy on loopback, storing objects under ``workdir/data``."""

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
        jar = s3proxy_jar()
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "s3proxy.conf"
        conf.write_text("\n".join([
            f"s3proxy.endpoint={self.endpoint}", "s3proxy.authorization=aws-v2-or-v4",
            f"s3proxy.identity={ACCESS_KEY}", f"s3proxy.credential={SECRET_KEY}",
            "jclouds.provider=filesystem", f"jclouds.filesystem.basedir={data}", ""]))
        log = (self.workdir / "s3proxy.log").open("wb")
        self.proc = subprocess.Popen(["java", "-Xmx256m", "-jar", str(jar), "--properties", str(conf)],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
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
                raise RuntimeError(f"s3proxy exited {self.proc.returncode}; see {self.workdir / 's3proxy.log'}")
            try:
                client.list_buckets()
                return
            except Exception as exc:  # not up yet
                last = exc
                time.sleep(0.3)
        raise RuntimeError(f"s3proxy not ready within {timeout_s}s: {last!r}")

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
