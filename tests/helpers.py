"""Test helpers: a real agentenv server in a subprocess, and a minimal Connect client for
envd's ``process.Process/Start`` stream (the wire format the E2B SDK uses)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent

# A guest command starting a background process that counts in /dev/shm/counter (RAM:
# it survives only if memory does) five times a second; prints the process's pid. The
# count is replaced atomically, so a reader never sees an empty file.
COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /dev/shm/.counter; "
    "mv /dev/shm/.counter /dev/shm/counter; sleep 0.2; done' >/dev/null 2>&1 & echo $!"
)
TEST_API_KEY = "e2b_" + "ab" * 20
# The domain of the shared test server (conftest's `server`): `{port}-{id}.sandbox.test`
# routes to a sandbox's port.
SANDBOX_DOMAIN = "sandbox.test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """An ``aenv-server`` child process with its own data directory."""

    home: Path
    port: int = field(default_factory=free_port)
    api_key: str = TEST_API_KEY
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    #: The checkout whose code the server runs (benchmarks compare two).
    root: Path = ROOT
    #: With AENV_TLS_CERT in ``extra_env``: the CA that signed it (the server is https).
    ca_file: Path | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.ca_file is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What clients of this server verify its certificate with."""
        if self.ca_file is None:
            return True
        return ssl.create_default_context(cafile=str(self.ca_file))

    @property
    def log_path(self) -> Path:
        return self.home.parent / f"{self.home.name}-server.log"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            AENV_HOME=str(self.home),
            AENV_LISTEN=f"127.0.0.1:{self.port}",
            AENV_API_KEY=self.api_key,
        )
        env.update(self.extra_env)
        return env

    def start(self, wait_template: float = 600.0) -> None:
        self.spawn()
        self.wait_ready(wait_template)

    def spawn(self) -> None:
        """Start the server process, its output appended to :attr:`log_path`."""
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agentenv.server"],
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
            )

    def wait_ready(
        self,
        limit: float,
        *,
        poll_every: float = 0.5,
        retry_every: float = 0.2,
        request_timeout: float = 2.0,
    ) -> None:
        """Wait until the spawned server's base template is ready: /health every
        ``poll_every`` seconds through one client, every ``retry_every`` while the server
        does not answer yet."""
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + limit
        with httpx.Client(
            timeout=request_timeout, verify=self.verify, headers={"X-API-Key": self.api_key}
        ) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited early:\n{self.log_tail()}")
                try:
                    health = client.get(f"{self.url}/health").json()
                except (httpx.HTTPError, ValueError):
                    time.sleep(retry_every)
                    continue
                state = health["templates"].get("base")
                if state == "ready":
                    return
                if state == "failed":
                    raise RuntimeError(f"base template failed: {health.get('detail')}")
                time.sleep(poll_every)
        raise RuntimeError(f"server not ready in {limit:.0f} s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def netns_names(self) -> set[str]:
        """The network namespaces of this server's sandboxes (others' servers, say a
        benchmark's on the same machine, come and go meanwhile)."""
        from agentenv.config import Config

        prefix = f"ae{Config.load(env={}, home=self.home).instance_tag}-"
        return {name for name in netns_names() if name.startswith(prefix)}

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            headers={"X-API-Key": self.api_key},
            timeout=120,
            trust_env=False,
            verify=self.verify,
        )


def create_sandbox(
    api: httpx.Client | ServerProcess, template: str = "base", **body: object
) -> dict[str, Any]:
    """Create a sandbox of ``template`` through the API (``body``: the other fields of
    the request) and return what the API answered; fails the test unless it was created.
    ``api`` is a client, or a server to open one to."""
    if isinstance(api, ServerProcess):
        with api.client() as client:
            return create_sandbox(client, template, **body)
    response = api.post("/sandboxes", json={"templateID": template, **body})
    assert response.status_code == 201, response.text
    data = response.json()
    assert isinstance(data, dict)
    return data


def create_sandbox_id(
    api: httpx.Client | ServerProcess, template: str = "base", **body: object
) -> str:
    """The id of a sandbox created as :func:`create_sandbox` does."""
    return str(create_sandbox(api, template, **body)["sandboxID"])


def cleanup_host(home: Path) -> None:
    """Kill the VMMs and remove the network resources a server with data directory
    ``home`` may have left (VMMs outlive their server by design)."""
    from agentenv.config import Config
    from agentenv.network import NetworkManager
    from agentenv.orchestrator.resources import resolve_subnet

    kill_vmms(str(home))
    config = Config.load(env={}, home=home)
    manager = NetworkManager(prefix=f"ae{config.instance_tag}", subnet=resolve_subnet(config))
    asyncio.run(manager.reclaim(set()))


@contextlib.contextmanager
def live_server(srv: ServerProcess) -> Iterator[ServerProcess]:
    """``srv`` started (template ready) for the block; afterwards its sandboxes are
    killed, the server stopped and its host resources released, also on failure."""
    try:
        srv.start()
        yield srv
        with srv.client() as c:
            for item in c.get("/sandboxes").json():
                c.delete(f"/sandboxes/{item['sandboxID']}")
    finally:
        srv.stop()
        cleanup_host(srv.home)


def vmm_pids(marker: str) -> list[int]:
    """PIDs of VMM processes whose command line mentions ``marker`` (a path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline and ("qemu-system" in cmdline or "firecracker" in cmdline):
            pids.append(int(entry.name))
    return pids


def netns_names() -> set[str]:
    path = Path("/run/netns")
    return {p.name for p in path.iterdir()} if path.exists() else set()


def kill_vmms(marker: str) -> None:
    for pid in vmm_pids(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes


def raw_http(
    port: int,
    method: str,
    target: str,
    headers: dict[str, str],
    body: bytes = b"",
    *,
    timeout: float = 60.0,
) -> RawResponse:
    """One HTTP/1.1 request written byte for byte as given (``target`` is not
    normalised, unlike with httpx or curl without ``--path-as-is``), read to the end."""
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() != "host"]
    if "host" in {k.lower() for k in headers}:
        lines[1] = f"Host: {next(v for k, v in headers.items() if k.lower() == 'host')}"
    lines.append(f"Content-Length: {len(body)}")
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        parsed[name.strip().lower()] = value.strip()
    if parsed.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return RawResponse(int(status_line.split(" ", 2)[1]), parsed, rest)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


# -- Connect RPC (JSON codec), as the E2B SDK speaks it ------------------------------------
def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack(">BI", flags, len(body)) + body


def read_envelopes(data: bytes) -> Iterator[tuple[int, dict[str, Any]]]:
    offset = 0
    while offset < len(data):
        flags, length = struct.unpack(">BI", data[offset : offset + 5])
        yield flags, json.loads(data[offset + 5 : offset + 5 + length] or b"{}")
        offset += 5 + length


@dataclass
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    status: str
    events: list[dict[str, Any]]


def envd_token(base_url: str, sandbox_id: str, api_key: str = TEST_API_KEY) -> str | None:
    """The sandbox's envd access token, as its detail reports it to the key holder."""
    detail = httpx.get(
        f"{base_url}/sandboxes/{sandbox_id}",
        headers={"X-API-Key": api_key},
        timeout=60,
        trust_env=False,
    )
    assert detail.status_code == 200, detail.text
    token = detail.json().get("envdAccessToken")
    return str(token) if token else None


def run_command(
    base_url: str,
    sandbox_id: str,
    command: str,
    *,
    envs: dict[str, str] | None = None,
    cwd: str | None = None,
    user: str | None = None,
    token: str | None = None,
    timeout: float = 60.0,
) -> CommandResult:
    """Run ``command`` the way ``Sandbox.commands.run`` does: ``/bin/bash -l -c``,
    through the server's proxy, routed by the ``E2b-Sandbox-Id`` header. Without a
    ``token`` the sandbox's own is looked up (every sandbox is secured); ``token=""``
    sends none."""
    if token is None:
        token = envd_token(base_url, sandbox_id)
    process: dict[str, Any] = {"cmd": "/bin/bash", "args": ["-l", "-c", command]}
    if envs:
        process["envs"] = envs
    if cwd:
        process["cwd"] = cwd
    headers = {
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
        "E2b-Sandbox-Id": sandbox_id,
        "E2b-Sandbox-Port": "49983",
    }
    if token:
        headers["X-Access-Token"] = token
    if user:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
    response = httpx.post(
        f"{base_url}/process.Process/Start",
        content=envelope({"process": process, "stdin": False}),
        headers=headers,
        timeout=timeout,
        trust_env=False,
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/connect+json"
    stdout, stderr, events = b"", b"", []
    exit_code, status = None, ""
    envelopes = list(read_envelopes(response.content))
    assert envelopes[-1][0] == 2, "stream must finish with an end-stream envelope"
    assert "error" not in envelopes[-1][1], envelopes[-1][1]
    for flags, message in envelopes[:-1]:
        assert flags == 0
        event = message["event"]
        events.append(event)
        if "data" in event:
            stdout += base64.b64decode(event["data"].get("stdout", ""))
            stderr += base64.b64decode(event["data"].get("stderr", ""))
        if "end" in event:
            exit_code = int(event["end"].get("exitCode", 0))
            status = event["end"].get("status", "")
    assert "start" in events[0], f"first event must be start, got {events[0]}"
    assert exit_code is not None, "stream ended without an end event"
    return CommandResult(stdout.decode(), stderr.decode(), exit_code, status, events)


#: Virtualenvs of tools tests run apart from the project's dependencies (PyPI only).
TEST_VENVS = Path("/var/cache/agentenv/test-venvs")


def cached_venv(name: str, requirement: str) -> Path:
    """A virtualenv ``TEST_VENVS/name`` with ``requirement`` installed, built once. A
    marker written last tells a finished install from an interrupted one, which is
    thrown away and rebuilt."""
    venv = TEST_VENVS / name
    done = venv / ".installed"
    if done.exists():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    TEST_VENVS.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", requirement],
            check=True,
            timeout=600,
        )
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise
    done.write_text(requirement + "\n")
    return venv


def drop_from_page_cache(path: Path) -> Path:
    """``path`` written back and its pages dropped from the host's page cache (clean,
    unmapped pages go; a filesystem like tmpfs keeps them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path
