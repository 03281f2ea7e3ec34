"""envd on the host: a real `python -m agentenv.envd` subprocess on a random localhost
port, driven by the generated Connect client (JSON codec, like the E2B SDK) and by raw
HTTP to check the wire framing the SDK depends on."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import gzip
import hashlib
import io
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from connectrpc.code import Code
from connectrpc.codec import proto_json_codec
from connectrpc.errors import ConnectError
from e2b.api.client_sync import get_envd_api
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import FileNotFoundException
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox_sync.commands.command import Commands
from e2b.sandbox_sync.commands.pty import Pty
from e2b.sandbox_sync.filesystem.filesystem import Filesystem
from packaging.version import Version
from protobuf import Oneof

from agentenv.envd.filesystem_service import go_mode_string
from agentenv.envd.gen.filesystem_connect import FilesystemClient
from agentenv.envd.gen.filesystem_pb import (
    CreateWatcherRequest,
    EventType,
    FileType,
    GetWatcherEventsRequest,
    RemoveWatcherRequest,
    StatRequest,
    WatchDirRequest,
)
from agentenv.envd.gen.process_connect import ProcessClient
from agentenv.envd.gen.process_pb import (
    PTY,
    CloseStdinRequest,
    ConnectRequest,
    ListRequest,
    ProcessConfig,
    ProcessInput,
    ProcessSelector,
    SendInputRequest,
    SendSignalRequest,
    Signal,
    StartRequest,
    StreamInputRequest,
    UpdateRequest,
)
from agentenv.envd.multipart import MultipartParser, PartData, PartEnd, PartStart
from agentenv.envd.processes import ProcessExit
from agentenv.envd.server import _listen
from agentenv.envd.signatures import file_signature
from agentenv.envd.state import InitError, InitRequest

REPO = Path(__file__).resolve().parents[1]
STREAM_CONTENT_TYPE = "application/connect+json"
# envd's own environment carries these; user processes must not see them.
LEAKY_ENV = {"PYTHONPATH": "/envd-test-leak", "LD_LIBRARY_PATH": "/envd-test-leak"}


class Envd:
    """One envd subprocess on 127.0.0.1."""

    def __init__(self, state_file: Path | None = None) -> None:
        self.port = _free_port()
        self.control_port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        #: Where /init is served: envd's control port, the node's only.
        self.control_url = f"http://127.0.0.1:{self.control_port}"
        env = {**os.environ, **LEAKY_ENV}
        env["PYTHONPATH"] = f"{REPO}{os.pathsep}{LEAKY_ENV['PYTHONPATH']}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentenv.envd",
                "--port",
                str(self.port),
                "--control-port",
                str(self.control_port),
                "--host",
                "127.0.0.1",
                "--no-system-changes",
                *(["--state-file", str(state_file)] if state_file else []),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        # Bounded by attempts, not asserted on: only readiness polling.
        for _ in range(300):
            if self.proc.poll() is not None:
                output = self.proc.stdout.read().decode() if self.proc.stdout else ""
                raise RuntimeError(f"envd exited with {self.proc.returncode}: {output}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 204:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("envd did not become healthy")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def envd() -> Iterator[Envd]:
    server = Envd()
    yield server
    server.stop()


@pytest.fixture
def fresh_envd() -> Iterator[Envd]:
    """An envd of its own, for tests that change global state (the access token)."""
    server = Envd()
    yield server
    server.stop()


@pytest.fixture
async def client(envd: Envd) -> AsyncIterator[ProcessClient]:
    async with ProcessClient(envd.url, codec=proto_json_codec(), send_compression=None) as c:
        yield c


def bash(command: str, **kwargs: Any) -> StartRequest:
    return StartRequest(
        process=ProcessConfig(cmd="/bin/bash", args=["-l", "-c", command], **kwargs),
        stdin=False,
    )


def by_pid(pid: int) -> ProcessSelector:
    return ProcessSelector(selector=Oneof("pid", pid))


def stdin_input(selector: ProcessSelector, data: bytes) -> SendInputRequest:
    return SendInputRequest(process=selector, input=ProcessInput(input=Oneof("stdin", data)))


def basic_user(name: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{name}:".encode()).decode()}


async def collect(stream: AsyncIterator[Any]) -> list[tuple[str, Any]]:
    """Every event of a Start/Connect stream as (kind, value)."""
    events = []
    async for response in stream:
        match response.event.event:
            case Oneof(field=field, value=value):
                events.append((field, value))
    return events


def output(events: list[tuple[str, Any]], stream: str) -> bytes:
    return b"".join(v.output.value for k, v in events if k == "data" and v.output.field == stream)


def end_of(events: list[tuple[str, Any]]) -> Any:
    assert events[-1][0] == "end", events
    assert [k for k, _ in events].count("end") == 1
    return events[-1][1]


def envelope(message: dict[str, Any]) -> bytes:
    data = json.dumps(message).encode()
    return b"\x00" + struct.pack(">I", len(data)) + data


def parse_envelopes(body: bytes) -> list[tuple[int, dict[str, Any]]]:
    frames = []
    offset = 0
    while offset < len(body):
        flags = body[offset]
        (length,) = struct.unpack(">I", body[offset + 1 : offset + 5])
        frames.append((flags, json.loads(body[offset + 5 : offset + 5 + length])))
        offset += 5 + length
    assert offset == len(body)
    return frames


# -- HTTP endpoints --------------------------------------------------------------------


def test_help_exits_zero() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agentenv.envd", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0
    assert "--port" in result.stdout


def test_health_is_204(envd: Envd) -> None:
    response = httpx.get(f"{envd.url}/health")
    assert response.status_code == 204
    assert response.content == b""


def test_init_rejects_bad_bodies(envd: Envd) -> None:
    assert httpx.post(f"{envd.control_url}/init", content=b"{nope").status_code == 400
    bad_user = httpx.post(f"{envd.control_url}/init", json={"defaultUser": "no-such-user-envd"})
    assert bad_user.status_code == 400
    assert "no-such-user-envd" in bad_user.json()["message"]
    assert (
        httpx.post(f"{envd.control_url}/init", json={"timestamp": "yesterday"}).status_code == 400
    )
    assert httpx.post(f"{envd.control_url}/init", json={"seed": "***"}).status_code == 400


async def test_init_env_vars_reach_processes(envd: Envd, client: ProcessClient) -> None:
    body = {
        "envVars": {"ENVD_TEST_VAR": "from-init"},
        "timestamp": "2026-01-02T03:04:05.123456789Z",
        "seed": base64.b64encode(b"entropy").decode(),
    }
    async with httpx.AsyncClient(base_url=envd.control_url) as control:
        assert (await control.post("/init", json=body)).status_code == 204
        # Calling it again (as after every snapshot restore) is fine and merges.
        assert (await control.post("/init", json={"envVars": {"OTHER": "x"}})).status_code == 204
    async with httpx.AsyncClient(base_url=envd.url) as http:
        envs = (await http.get("/envs")).json()
    assert envs["ENVD_TEST_VAR"] == "from-init"
    assert envs["OTHER"] == "x"

    events = await collect(client.start(bash("echo $ENVD_TEST_VAR")))
    assert output(events, "stdout") == b"from-init\n"

    # The request's envs win over the sandbox's.
    events = await collect(
        client.start(bash("echo $ENVD_TEST_VAR", envs={"ENVD_TEST_VAR": "from-request"}))
    )
    assert output(events, "stdout") == b"from-request\n"


async def test_process_environment_is_clean(client: ProcessClient) -> None:
    events = await collect(client.start(StartRequest(process=ProcessConfig(cmd="/usr/bin/env"))))
    env = dict(line.split("=", 1) for line in output(events, "stdout").decode().splitlines())
    me = pwd.getpwuid(os.geteuid())
    assert env["HOME"] == me.pw_dir
    assert env["USER"] == env["LOGNAME"] == me.pw_name
    assert env["PATH"]
    for name in LEAKY_ENV:
        assert name not in env


# -- Start: framing ----------------------------------------------------------------------


def test_start_stream_framing(envd: Envd) -> None:
    request = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"]}, "stdin": False}
    response = httpx.post(
        f"{envd.url}/process.Process/Start",
        content=envelope(request),
        headers={"Content-Type": STREAM_CONTENT_TYPE},
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == STREAM_CONTENT_TYPE
    frames = parse_envelopes(response.content)
    flags = [f for f, _ in frames]
    assert flags[:-1] == [0] * (len(frames) - 1)
    assert frames[-1] == (0x02, {})
    messages = [m for _, m in frames[:-1]]
    assert set(messages[0]["event"]) == {"start"}
    assert messages[0]["event"]["start"]["pid"] > 0
    assert messages[1] == {"event": {"data": {"stdout": base64.b64encode(b"hi\n").decode()}}}
    # Exit code 0 is a default value, so it is omitted.
    assert messages[-1] == {"event": {"end": {"exited": True, "status": "exit status 0"}}}


def test_start_accepts_chunked_request_body(envd: Envd) -> None:
    def body() -> Iterator[bytes]:
        data = envelope({"process": {"cmd": "/bin/echo", "args": ["chunked"]}})
        yield data[:3]
        yield data[3:]

    response = httpx.post(
        f"{envd.url}/process.Process/Start",
        content=body(),
        headers={"Content-Type": STREAM_CONTENT_TYPE},
    )
    frames = parse_envelopes(response.content)
    stdout = [m["event"]["data"]["stdout"] for _, m in frames if "data" in m.get("event", {})]
    assert base64.b64decode("".join(stdout)) == b"chunked\n"


def test_missing_cwd_on_the_wire(envd: Envd) -> None:
    request = {"process": {"cmd": "/bin/true", "cwd": "/no/such/dir"}}
    response = httpx.post(
        f"{envd.url}/process.Process/Start",
        content=envelope(request),
        headers={"Content-Type": STREAM_CONTENT_TYPE},
    )
    frames = parse_envelopes(response.content)
    assert frames[-1][0] == 0x02
    assert frames[-1][1]["error"]["code"] == "invalid_argument"


# -- Start: semantics --------------------------------------------------------------------


async def test_echo(client: ProcessClient) -> None:
    events = await collect(client.start(bash("echo hello")))
    assert events[0][0] == "start" and events[0][1].pid > 0
    assert output(events, "stdout") == b"hello\n"
    end = end_of(events)
    assert (end.exit_code, end.exited, end.status) == (0, True, "exit status 0")
    assert not end.has_field("error")


async def test_exit_code(client: ProcessClient) -> None:
    end = end_of(await collect(client.start(bash("exit 3"))))
    assert (end.exit_code, end.exited) == (3, True)
    assert end.status == "exit status 3"
    assert end.error == "exit status 3"


async def test_stderr(client: ProcessClient) -> None:
    events = await collect(client.start(bash("echo oops >&2")))
    assert output(events, "stderr") == b"oops\n"
    assert output(events, "stdout") == b""


async def test_cwd(client: ProcessClient, tmp_path: Path) -> None:
    events = await collect(client.start(bash("pwd", cwd=str(tmp_path))))
    assert output(events, "stdout").decode().strip() == str(tmp_path)


async def test_missing_cwd_is_invalid_argument(client: ProcessClient) -> None:
    with pytest.raises(ConnectError) as raised:
        await collect(client.start(bash("pwd", cwd="/no/such/dir")))
    assert raised.value.code == Code.INVALID_ARGUMENT


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
async def test_runs_as_user_from_basic_auth(client: ProcessClient) -> None:
    events = await collect(
        client.start(bash("id -un; echo $HOME $USER", cwd="/"), headers=basic_user("nobody"))
    )
    nobody = pwd.getpwnam("nobody")
    assert output(events, "stdout").decode().splitlines() == [
        "nobody",
        f"{nobody.pw_dir} nobody",
    ]


async def test_unknown_user_is_unauthenticated(client: ProcessClient) -> None:
    with pytest.raises(ConnectError) as raised:
        await collect(client.start(bash("true"), headers=basic_user("no-such-user-envd")))
    assert raised.value.code == Code.UNAUTHENTICATED


async def test_timeout_kills_process(envd: Envd, client: ProcessClient) -> None:
    request = {"process": {"cmd": "/bin/bash", "args": ["-c", "sleep 30; echo done"]}}
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{envd.url}/process.Process/Start",
            content=envelope(request),
            headers={"Content-Type": STREAM_CONTENT_TYPE, "Connect-Timeout-Ms": "500"},
            timeout=60,
        )
    frames = parse_envelopes(response.content)
    pid = frames[0][1]["event"]["start"]["pid"]
    assert frames[-1][0] == 0x02
    assert frames[-1][1]["error"]["code"] == "deadline_exceeded"
    # The deadline killed the process; its end is retained for Connect.
    events = await collect(client.connect(ConnectRequest(process=by_pid(pid))))
    end = end_of(events)
    assert (end.exit_code, end.exited, end.status) == (-1, False, "signal: killed")
    assert output(events, "stdout") == b""


async def test_stdin_input_and_close(client: ProcessClient) -> None:
    stream = client.start(StartRequest(process=ProcessConfig(cmd="/bin/cat"), stdin=True))
    first = await anext(stream)
    pid = first.event.event.value.pid
    selector = by_pid(pid)
    await client.send_input(stdin_input(selector, b"line\n"))
    await client.close_stdin(CloseStdinRequest(process=selector))
    events = await collect(stream)
    assert output(events, "stdout") == b"line\n"
    assert end_of(events).exit_code == 0


async def test_stdin_false_gives_eof(client: ProcessClient) -> None:
    events = await collect(
        client.start(StartRequest(process=ProcessConfig(cmd="/bin/cat"), stdin=False))
    )
    assert output(events, "stdout") == b""
    assert end_of(events).exit_code == 0


async def test_keepalive_during_silence(envd: Envd) -> None:
    async with ProcessClient(envd.url, codec=proto_json_codec(), send_compression=None) as c:
        stream = c.start(
            StartRequest(process=ProcessConfig(cmd="/bin/bash", args=["-c", "read x; echo $x"])),
            headers={"Keepalive-Ping-Interval": "1"},
        )
        pid = (await anext(stream)).event.event.value.pid
        # The process waits for input, so the next event can only be a keepalive.
        assert (await anext(stream)).event.event.field == "keepalive"
        await c.send_input(stdin_input(by_pid(pid), b"go\n"))
        events = await collect(stream)
        assert output(events, "stdout") == b"go\n"


async def test_disconnect_leaves_process_running(client: ProcessClient) -> None:
    stream = client.start(StartRequest(process=ProcessConfig(cmd="/bin/cat"), stdin=True))
    pid = (await anext(stream)).event.event.value.pid
    await stream.aclose()

    listed = await client.list(ListRequest())
    assert pid in [p.pid for p in listed.processes]
    selector = by_pid(pid)
    follower = client.connect(ConnectRequest(process=selector))
    assert (await anext(follower)).event.event.field == "start"
    await client.send_input(stdin_input(selector, b"x\n"))
    await client.close_stdin(CloseStdinRequest(process=selector))
    events = await collect(follower)
    assert output(events, "stdout") == b"x\n"
    assert end_of(events).exit_code == 0


async def read_pty_until(stream: AsyncIterator[Any], text: str) -> str:
    """PTY output up to and including ``text``."""
    seen = b""
    async for response in stream:
        event = response.event.event
        assert event.field in ("data", "keepalive"), event
        if event.field == "data":
            chunk: bytes = event.value.output.value
            seen += chunk
            if text.encode() in seen:
                return seen.decode()
    raise AssertionError(f"stream ended before {text!r}: {seen!r}")


async def test_pty(client: ProcessClient) -> None:
    script = "tty; stty size; read x; stty size; echo got $x"
    stream = client.start(
        StartRequest(
            process=ProcessConfig(cmd="/bin/bash", args=["-c", script]),
            pty=PTY(size=PTY.Size(cols=100, rows=30)),
        )
    )
    selector = by_pid((await anext(stream)).event.event.value.pid)
    first = await read_pty_until(stream, "30 100")
    assert first.splitlines()[0].startswith("/dev/pts/")
    # bash is now blocked in `read`, so the resize lands before the second `stty size`.
    await client.update(UpdateRequest(process=selector, pty=PTY(size=PTY.Size(cols=120, rows=40))))
    await client.send_input(
        SendInputRequest(process=selector, input=ProcessInput(input=Oneof("pty", b"hello\r")))
    )
    events = await collect(stream)
    lines = output(events, "pty").decode().splitlines()
    assert "40 120" in lines
    assert lines[-1] == "got hello"
    assert end_of(events).exit_code == 0


async def test_send_signal(client: ProcessClient) -> None:
    stream = client.start(bash("sleep 30"))
    pid = (await anext(stream)).event.event.value.pid
    await client.send_signal(SendSignalRequest(process=by_pid(pid), signal=Signal.SIGTERM))
    end = end_of(await collect(stream))
    assert (end.exit_code, end.exited, end.status) == (-1, False, "signal: terminated")

    with pytest.raises(ConnectError) as raised:
        await client.send_signal(SendSignalRequest(process=by_pid(pid), signal=Signal.SIGKILL))
    assert raised.value.code == Code.NOT_FOUND


async def test_connect_unknown_pid_is_not_found(client: ProcessClient) -> None:
    with pytest.raises(ConnectError) as raised:
        await collect(client.connect(ConnectRequest(process=by_pid(2**31))))
    assert raised.value.code == Code.NOT_FOUND


# -- Filesystem --------------------------------------------------------------------------


async def test_stat(envd: Envd, tmp_path: Path) -> None:
    target = tmp_path / "file.txt"
    target.write_bytes(b"twelve bytes")
    target.chmod(0o644)
    async with FilesystemClient(envd.url, codec=proto_json_codec(), send_compression=None) as fs:
        entry = (await fs.stat(StatRequest(path=str(target)))).entry
        assert (entry.name, entry.path, entry.type) == ("file.txt", str(target), FileType.FILE)
        assert (entry.size, entry.mode, entry.permissions) == (12, 0o644, "-rw-r--r--")
        assert entry.owner == pwd.getpwuid(os.geteuid()).pw_name
        with pytest.raises(ConnectError) as raised:
            await fs.stat(StatRequest(path=str(tmp_path / "missing")))
        assert raised.value.code == Code.NOT_FOUND


# -- Access token ------------------------------------------------------------------------


async def test_access_token_enforced(fresh_envd: Envd) -> None:
    url = fresh_envd.url
    token = {"X-Access-Token": "s3cret"}
    async with httpx.AsyncClient(base_url=fresh_envd.control_url) as control:
        assert (await control.post("/init", json={"accessToken": "s3cret"})).status_code == 204
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/health")).status_code == 204
        assert (await http.get("/envs")).status_code == 401
        assert (await http.get("/envs", headers={"X-Access-Token": "no"})).status_code == 401
        assert (await http.get("/envs", headers=token)).status_code == 200

    async with ProcessClient(url, codec=proto_json_codec(), send_compression=None) as c:
        with pytest.raises(ConnectError) as raised:
            await collect(c.start(bash("echo hi")))
        assert raised.value.code == Code.UNAUTHENTICATED
        events = await collect(c.start(bash("echo hi"), headers=token))
        assert output(events, "stdout") == b"hi\n"


def test_a_restarted_envd_keeps_its_configuration(tmp_path: Path) -> None:
    """The guest's init restarts an envd that died (kill -9, OOM); the new one reads
    what /init configured from its state file instead of coming back open, with no
    token, the wrong user and no env vars."""
    state_file = tmp_path / "run" / "aenv" / "envd-state.json"
    first = Envd(state_file)
    try:
        init = {"accessToken": "kept", "envVars": {"KEPT": "yes"}, "defaultWorkdir": "/tmp"}
        assert httpx.post(f"{first.control_url}/init", json=init).status_code == 204
        assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(state_file.parent.stat().st_mode) == 0o700
        first.proc.kill()
        first.proc.wait()
    finally:
        first.stop()
    second = Envd(state_file)
    try:
        token = {"X-Access-Token": "kept"}
        assert httpx.get(f"{second.url}/envs").status_code == 401
        assert httpx.get(f"{second.url}/envs", headers=token).json() == {"KEPT": "yes"}

        async def run() -> bytes:
            async with ProcessClient(
                second.url, codec=proto_json_codec(), send_compression=None
            ) as c:
                return output(
                    await collect(c.start(bash("echo $KEPT; pwd"), headers=token)), "stdout"
                )

        assert asyncio.run(run()) == b"yes\n/tmp\n"
    finally:
        second.stop()
    # A state file it cannot read is ignored, not fatal.
    state_file.write_text("{not json")
    third = Envd(state_file)
    try:
        assert httpx.get(f"{third.url}/envs").status_code == 200  # unconfigured
    finally:
        third.stop()


def test_init_is_served_on_the_control_port_only(fresh_envd: Envd) -> None:
    """The public port (the one the proxy forwards to) has no /init at all, whatever the
    path's spelling; the control port serves /init and nothing else."""
    public, control = fresh_envd.url, fresh_envd.control_url
    for path in ("/init", "/init/", "/files/../init", "//init", "/%69nit"):
        # A raw socket: httpx would normalise some of these spellings away.
        status = _raw_status(fresh_envd.port, "POST", path, b'{"defaultUser":"root"}')
        assert status in (400, 401, 404), (path, status)
    assert httpx.post(f"{control}/init", json={"accessToken": "tok"}).status_code == 204
    # Now secured: the same spellings on the public port still do nothing.
    for path in ("/init", "/files/../init"):
        status = _raw_status(fresh_envd.port, "POST", path, b'{"accessToken":"mine"}')
        assert status in (400, 401, 404), (path, status)
    assert httpx.get(f"{public}/envs").status_code == 401
    assert httpx.get(f"{public}/envs", headers={"X-Access-Token": "tok"}).status_code == 200
    # The control port answers nothing but /init.
    for path in ("/envs", "/health", "/files", "/process.Process/List"):
        assert httpx.get(f"{control}{path}").status_code == 404, path
    assert httpx.get(f"{control}/init").status_code == 405


def test_an_empty_token_never_switches_checking_off(fresh_envd: Envd) -> None:
    control, public = fresh_envd.control_url, fresh_envd.url
    assert httpx.post(f"{control}/init", json={"accessToken": "tok"}).status_code == 204
    for empty in ("", "  "):
        refused = httpx.post(f"{control}/init", json={"accessToken": empty})
        assert refused.status_code == 400, refused.text
        assert "accessToken" in refused.json()["message"]
    assert httpx.get(f"{public}/envs").status_code == 401
    assert httpx.get(f"{public}/envs", headers={"X-Access-Token": ""}).status_code == 401
    assert httpx.get(f"{public}/envs", headers={"X-Access-Token": "tok"}).status_code == 200


async def test_envd_connections_have_nagle_off() -> None:
    """asyncio sets TCP_NODELAY only on sockets whose proto says TCP; envd makes its own
    listeners, and without it a response written in pieces waited for delayed ACKs."""
    listener = _listen("127.0.0.1", 0)
    seen: list[int] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(
            writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        )
        writer.close()

    server = await asyncio.start_server(accepted, sock=listener)
    async with server:
        _, writer = await asyncio.open_connection(*listener.getsockname())
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
    assert seen and seen[0] != 0


def _raw_status(port: int, method: str, path: str, body: bytes) -> int:
    """The status envd answers to a request sent byte for byte as written."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: envd\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            assert chunk, f"envd closed the connection without answering {path}"
            head += chunk
    return int(head.split(b" ", 2)[1])


def test_sigterm_exits_cleanly(fresh_envd: Envd) -> None:
    assert fresh_envd.stop() == 0


def _context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches of every thread of ``pid`` so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


def test_idle_envd_sleeps(fresh_envd: Envd) -> None:
    # Every wakeup of an idle guest's envd costs the node CPU (Python at TCG speed); uvicorn's
    # own main loop woke ten times a second, 20 times in this window.
    time.sleep(0.5)  # let the health check's connection finish closing
    before = _context_switches(fresh_envd.proc.pid)
    time.sleep(2)
    woke = _context_switches(fresh_envd.proc.pid) - before
    assert woke <= 2, f"idle envd woke {woke} times in 2 s"
    # It still answers, and still stops cleanly on SIGTERM.
    assert httpx.get(f"{fresh_envd.url}/health", timeout=5).status_code == 204
    assert fresh_envd.stop() == 0


# -- Pure helpers ------------------------------------------------------------------------


def test_init_request_parsing() -> None:
    request = InitRequest.from_json(
        {
            "envVars": {"A": "1"},
            "accessToken": "t",
            "timestamp": "2026-01-02T03:04:05.123456789Z",
            "defaultUser": "root",
            "defaultWorkdir": "/tmp",
            "seed": base64.b64encode(b"abc").decode(),
            "hyperloopIP": "ignored",
        }
    )
    assert request.env_vars == {"A": "1"}
    assert request.timestamp == dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.UTC)
    assert request.seed == b"abc"
    with pytest.raises(InitError):
        InitRequest.from_json({"envVars": {"A": 1}})
    with pytest.raises(InitError):
        InitRequest.from_json({"timestamp": "2026-01-02T03:04:05"})  # no offset
    with pytest.raises(InitError):
        InitRequest.from_json([])
    with pytest.raises(InitError, match="accessToken"):
        InitRequest.from_json({"accessToken": ""})


SEGV_CORE = "signal: segmentation fault (core dumped)"


@pytest.mark.parametrize(
    ("wait_status", "expected"),
    [
        (0, (0, True, "exit status 0", None)),
        (3 << 8, (3, True, "exit status 3", "exit status 3")),
        (signal.SIGKILL, (-1, False, "signal: killed", "signal: killed")),
        (signal.SIGSEGV | 0x80, (-1, False, SEGV_CORE, SEGV_CORE)),
    ],
)
def test_process_exit_matches_go(wait_status: int, expected: tuple[Any, ...]) -> None:
    end = ProcessExit.from_wait_status(wait_status)
    assert (end.exit_code, end.exited, end.status, end.error) == expected


def test_go_mode_string() -> None:
    assert go_mode_string(stat.S_IFREG | 0o644) == "-rw-r--r--"
    assert go_mode_string(stat.S_IFDIR | 0o755) == "drwxr-xr-x"
    assert go_mode_string(stat.S_IFLNK | 0o777) == "Lrwxrwxrwx"
    assert go_mode_string(stat.S_IFREG | stat.S_ISUID | 0o755) == "urwxr-xr-x"
    assert go_mode_string(stat.S_IFCHR | 0o666) == "Dcrw-rw-rw-"
    assert go_mode_string(stat.S_IFDIR | stat.S_ISVTX | 0o777) == "dtrwxrwxrwx"


# -- /files --------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_files_round_trip_text_and_bytes(envd: Envd, tmp_path: Path) -> None:
    target = tmp_path / "new" / "dir" / "a.txt"
    written = httpx.post(
        f"{envd.url}/files",
        params={"path": str(target)},
        files={"file": (str(target), b"hello\n", "text/plain")},
    )
    assert written.status_code == 200, written.text
    assert written.json() == [{"path": str(target), "name": "a.txt", "type": "file"}]
    assert stat.S_IMODE(target.stat().st_mode) == 0o644

    read = httpx.get(f"{envd.url}/files", params={"path": str(target)})
    assert read.status_code == 200
    assert read.content == b"hello\n"
    assert read.headers["content-type"].startswith("text/plain")
    assert read.headers["content-disposition"] == 'inline; filename="a.txt"'

    blob = bytes(range(256)) * 3
    raw = httpx.post(
        f"{envd.url}/files",
        params={"path": str(tmp_path / "b.bin")},
        content=blob,
        headers={"Content-Type": "application/octet-stream"},
    )
    assert raw.status_code == 200, raw.text
    read = httpx.get(
        f"{envd.url}/files",
        params={"path": str(tmp_path / "b.bin")},
        headers={"Accept-Encoding": "identity"},
    )
    assert read.content == blob
    assert read.headers["content-type"] == "application/octet-stream"
    assert read.headers["content-length"] == str(len(blob))
    # No staging files are left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "new"]


def test_files_range_gzip_and_errors(envd: Envd, tmp_path: Path) -> None:
    target = tmp_path / "r.txt"
    target.write_bytes(b"0123456789" * 100)
    url = f"{envd.url}/files"
    part = httpx.get(url, params={"path": str(target)}, headers={"Range": "bytes=5-14"})
    assert part.status_code == 206
    assert part.content == b"5678901234"
    assert part.headers["content-range"] == "bytes 5-14/1000"
    suffix = httpx.get(url, params={"path": str(target)}, headers={"Range": "bytes=-3"})
    assert suffix.content == b"789"
    bad = httpx.get(url, params={"path": str(target)}, headers={"Range": "bytes=5000-"})
    assert bad.status_code == 416

    with httpx.Client() as http:
        request = http.build_request(
            "GET", url, params={"path": str(target)}, headers={"Accept-Encoding": "gzip"}
        )
        response = http.send(request, stream=True)
        compressed = b"".join(response.iter_raw())
        assert response.headers["content-encoding"] == "gzip"
        assert gzip.decompress(compressed) == target.read_bytes()
    refused = httpx.get(url, params={"path": str(target)}, headers={"Accept-Encoding": "br, *;q=0"})
    assert refused.status_code == 406
    # A generic list (httpx's default) gets identity: compressing only on explicit request.
    generic = httpx.get(
        url, params={"path": str(target)}, headers={"Accept-Encoding": "gzip, deflate"}
    )
    assert "content-encoding" not in generic.headers
    assert generic.content == target.read_bytes()
    no_identity = httpx.get(
        url, params={"path": str(target)}, headers={"Accept-Encoding": "gzip, identity;q=0"}
    )
    assert no_identity.headers["content-encoding"] == "gzip"

    missing = httpx.get(url, params={"path": str(tmp_path / "nope")})
    assert missing.status_code == 404
    assert missing.json()["code"] == 404
    assert httpx.get(url, params={"path": str(tmp_path)}).status_code == 400
    assert httpx.get(url, params={"path": "/etc", "username": "no-such-user-x"}).status_code == 401
    assert httpx.get(url).status_code == 400


def test_files_home_relative_paths(envd: Envd) -> None:
    home = Path(pwd.getpwuid(os.geteuid()).pw_dir)
    name = f".envd-test-{os.getpid()}.txt"
    try:
        written = httpx.post(
            f"{envd.url}/files",
            params={"path": name},
            content=b"home",
            headers={"Content-Type": "application/octet-stream"},
        )
        assert written.json()[0]["path"] == str(home / name)
        assert httpx.get(f"{envd.url}/files", params={"path": f"~/{name}"}).content == b"home"
    finally:
        (home / name).unlink(missing_ok=True)


def test_files_large_upload_and_download_stream(envd: Envd, tmp_path: Path) -> None:
    size = 10 * 1024 * 1024
    chunk = os.urandom(64 * 1024)
    digest = hashlib.sha256(chunk * (size // len(chunk))).hexdigest()
    target = tmp_path / "big.bin"
    before = rss_bytes(envd.proc.pid)

    def body() -> Iterator[bytes]:
        for _ in range(size // len(chunk)):
            yield chunk

    written = httpx.post(
        f"{envd.url}/files",
        params={"path": str(target)},
        content=body(),
        headers={"Content-Type": "application/octet-stream"},
        timeout=60,
    )
    assert written.status_code == 200, written.text
    assert target.stat().st_size == size
    assert hashlib.sha256(target.read_bytes()).hexdigest() == digest

    sha = hashlib.sha256()
    with httpx.stream(
        "GET",
        f"{envd.url}/files",
        params={"path": str(target)},
        headers={"Accept-Encoding": "identity"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-length"] == str(size)
        for data in response.iter_bytes():
            sha.update(data)
    assert sha.hexdigest() == digest
    # Streamed both ways: envd never held the file in memory.
    assert rss_bytes(envd.proc.pid) - before < size // 2


def multipart_body(parts: list[tuple[str, str, bytes]], boundary: str = "XyZ") -> bytes:
    out = b"preamble\r\n"
    for name, filename, data in parts:
        out += (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
                f'filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n'
            ).encode()
            + data
            + b"\r\n"
        )
    return out + f"--{boundary}--\r\n".encode()


def test_files_multipart_several_files(envd: Envd, tmp_path: Path) -> None:
    a, b = tmp_path / "m" / "a.txt", tmp_path / "m" / "sub" / "b.bin"
    body = multipart_body(
        [("file", str(a), b"A" * 70000), ("other", "ignored", b"x"), ("file", str(b), b"\r\n--X")]
    )
    response = httpx.post(
        f"{envd.url}/files",
        content=body,
        headers={"Content-Type": "multipart/form-data; boundary=XyZ"},
    )
    assert response.status_code == 200, response.text
    assert [f["path"] for f in response.json()] == [str(a), str(b)]
    assert a.read_bytes() == b"A" * 70000
    assert b.read_bytes() == b"\r\n--X"

    duplicate = multipart_body([("file", str(a), b"1"), ("file", str(a), b"2")])
    response = httpx.post(
        f"{envd.url}/files",
        content=duplicate,
        headers={"Content-Type": "multipart/form-data; boundary=XyZ"},
    )
    assert response.status_code == 400
    assert a.read_bytes() == b"A" * 70000  # all or nothing

    # The path query wins over the part's filename.
    c = tmp_path / "c.txt"
    response = httpx.post(
        f"{envd.url}/files", params={"path": str(c)}, files={"file": ("whatever.txt", b"C")}
    )
    assert response.json()[0]["path"] == str(c) and c.read_bytes() == b"C"

    onto_dir = httpx.post(
        f"{envd.url}/files", params={"path": str(tmp_path)}, files={"file": ("x", b"C")}
    )
    assert onto_dir.status_code == 400
    truncated = httpx.post(
        f"{envd.url}/files",
        content=body[:-10],
        headers={"Content-Type": "multipart/form-data; boundary=XyZ"},
    )
    assert truncated.status_code == 400
    assert not list((tmp_path / "m").glob(".envd-upload-*"))


def test_files_octet_stream_gzip_and_metadata(envd: Envd, tmp_path: Path) -> None:
    target = tmp_path / "g.txt"
    data = b"compress me " * 5000
    response = httpx.post(
        f"{envd.url}/files",
        params={"path": str(target)},
        content=gzip.compress(data),
        headers={
            "Content-Type": "application/octet-stream",
            "Content-Encoding": "gzip",
            "X-Metadata-Owner-Team": "Infra",
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()[0]["metadata"] == {"owner-team": "Infra"}
    assert target.read_bytes() == data
    assert os.getxattr(target, "user.e2b.owner-team") == b"Infra"
    bad = httpx.post(
        f"{envd.url}/files",
        params={"path": str(target)},
        content=b"not gzip",
        headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert bad.status_code == 400
    no_path = httpx.post(
        f"{envd.url}/files", content=b"x", headers={"Content-Type": "application/octet-stream"}
    )
    assert no_path.status_code == 400


async def test_stat_reports_metadata(envd: Envd, tmp_path: Path) -> None:
    target = tmp_path / "meta.txt"
    target.write_bytes(b"m")
    os.setxattr(target, "user.e2b.k", b"v")
    async with FilesystemClient(envd.url, codec=proto_json_codec(), send_compression=None) as fs:
        entry = (await fs.stat(StatRequest(path=str(target)))).entry
    assert dict(entry.metadata) == {"k": "v"}


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory other users can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="envd-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_files_use_the_users_permissions(envd: Envd, shared_dir: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    secret = shared_dir / "secret"
    secret.write_bytes(b"root only")
    secret.chmod(0o600)
    url = f"{envd.url}/files"
    denied = httpx.get(url, params={"path": str(secret), "username": "nobody"})
    assert denied.status_code == 403
    assert "permission denied" in denied.json()["message"]
    assert httpx.get(url, params={"path": str(secret), "username": "root"}).content == b"root only"

    # nobody cannot write into root's directory, nor create directories there.
    for path in (shared_dir / "x.txt", shared_dir / "d" / "x.txt", Path("/etc/envd-test-x")):
        response = httpx.post(
            url, params={"path": str(path), "username": "nobody"}, files={"file": ("x", b"x")}
        )
        assert response.status_code == 403, path
        assert not path.exists()

    writable = shared_dir / "open"
    writable.mkdir()
    os.chown(writable, nobody.pw_uid, nobody.pw_gid)
    target = writable / "new" / "f.txt"
    response = httpx.post(
        url, params={"path": str(target), "username": "nobody"}, files={"file": ("f", b"hi")}
    )
    assert response.status_code == 200, response.text
    for created in (target, target.parent):
        info = created.stat()
        assert (info.st_uid, info.st_gid) == (nobody.pw_uid, nobody.pw_gid)
    # envd's own threads got their root credentials back.
    assert httpx.get(url, params={"path": str(secret)}).content == b"root only"


def test_files_signatures(fresh_envd: Envd, tmp_path: Path) -> None:
    target = tmp_path / "signed.txt"
    target.write_bytes(b"signed")
    url = f"{fresh_envd.url}/files"
    assert (
        httpx.post(f"{fresh_envd.control_url}/init", json={"accessToken": "tok"}).status_code == 204
    )
    path = str(target)
    assert httpx.get(url, params={"path": path}).status_code == 401
    assert (
        httpx.get(url, params={"path": path}, headers={"X-Access-Token": "tok"}).status_code == 200
    )

    future = str(int(time.time()) + 300)
    good = {
        "path": path,
        "signature": file_signature(path, "read", "", "tok", future),
        "signature_expiration": future,
    }
    assert httpx.get(url, params=good).content == b"signed"
    # A present header must match even when the signature is good.
    assert httpx.get(url, params=good, headers={"X-Access-Token": "no"}).status_code == 401
    # Signed for another operation, user, path or an expired time: rejected.
    past = str(int(time.time()) - 5)
    for bad in (
        {**good, "signature": file_signature(path, "write", "", "tok", future)},
        {**good, "username": "root"},
        {**good, "path": path + "x"},
        {
            **good,
            "signature": file_signature(path, "read", "", "tok", past),
            "signature_expiration": past,
        },
    ):
        assert httpx.get(url, params=bad).status_code == 401
    no_expiry = {"path": path, "signature": file_signature(path, "read", "", "tok", None)}
    assert httpx.get(url, params=no_expiry).status_code == 200

    upload = str(tmp_path / "up.txt")
    signed_write = {
        "path": upload,
        "username": "root",
        "signature": file_signature(upload, "write", "root", "tok", None),
    }
    assert httpx.post(url, params=signed_write, files={"file": ("f", b"w")}).status_code == 200
    assert Path(upload).read_bytes() == b"w"


def test_multipart_parser_byte_by_byte() -> None:
    body = multipart_body([("file", "/a/b", b"one\r\n--Xy-not"), ("file", 'q\\"x', b"")])
    parser = MultipartParser("XyZ")
    events = []
    for i in range(len(body)):
        events += parser.feed(body[i : i + 1])
    parser.finish()
    starts = [e for e in events if isinstance(e, PartStart)]
    assert [(s.name, s.filename) for s in starts] == [("file", "/a/b"), ("file", 'q"x')]
    data = b"".join(e.data for e in events if isinstance(e, PartData))
    assert data == b"one\r\n--Xy-not"
    assert sum(isinstance(e, PartEnd) for e in events) == 2


# -- watchers ----------------------------------------------------------------------------


async def test_watch_dir_stream(envd: Envd, tmp_path: Path) -> None:
    (tmp_path / "old.txt").write_bytes(b"o")
    async with FilesystemClient(envd.url, codec=proto_json_codec(), send_compression=None) as fs:
        stream = fs.watch_dir(
            WatchDirRequest(path=str(tmp_path), recursive=True, include_entry=True),
            headers={"Keepalive-Ping-Interval": "1"},
        )
        assert (await anext(stream)).event.field == "start"
        (tmp_path / "sub").mkdir()
        await asyncio.sleep(0.2)  # lets the new directory's watch go in first
        (tmp_path / "sub" / "n.txt").write_bytes(b"new")
        (tmp_path / "old.txt").rename(tmp_path / "renamed.txt")
        (tmp_path / "renamed.txt").chmod(0o600)
        (tmp_path / "renamed.txt").unlink()
        expected = {
            ("sub", EventType.CREATE),
            ("sub/n.txt", EventType.CREATE),
            ("sub/n.txt", EventType.WRITE),
            ("old.txt", EventType.RENAME),
            ("renamed.txt", EventType.CREATE),
            ("renamed.txt", EventType.CHMOD),
            ("renamed.txt", EventType.REMOVE),
        }
        seen: dict[tuple[str, Any], Any] = {}
        async with asyncio.timeout(20):
            while not expected <= seen.keys():
                response = await anext(stream)
                if response.event.field == "filesystem":
                    event = response.event.value
                    seen[(event.name, event.type)] = event
        await stream.aclose()
    created = seen[("sub/n.txt", EventType.CREATE)]
    assert created.entry is not None and created.entry.path == str(tmp_path / "sub" / "n.txt")
    assert seen[("old.txt", EventType.RENAME)].entry is None


async def test_polled_watcher(envd: Envd, tmp_path: Path) -> None:
    async with FilesystemClient(envd.url, codec=proto_json_codec(), send_compression=None) as fs:
        created = await fs.create_watcher(CreateWatcherRequest(path=str(tmp_path)))
        watcher_id = created.watcher_id
        (tmp_path / "f.txt").write_bytes(b"x")
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "deep.txt").write_bytes(b"x")  # not recursive: unseen
        names: set[tuple[str, Any]] = set()
        async with asyncio.timeout(20):
            while not {("f.txt", EventType.CREATE), ("f.txt", EventType.WRITE)} <= names:
                events = await fs.get_watcher_events(GetWatcherEventsRequest(watcher_id=watcher_id))
                names |= {(e.name, e.type) for e in events.events}
                await asyncio.sleep(0.05)
        assert ("d", EventType.CREATE) in names
        assert not any(name.startswith("d/") for name, _ in names)
        await fs.remove_watcher(RemoveWatcherRequest(watcher_id=watcher_id))
        with pytest.raises(ConnectError) as raised:
            await fs.get_watcher_events(GetWatcherEventsRequest(watcher_id=watcher_id))
        assert raised.value.code == Code.NOT_FOUND

        with pytest.raises(ConnectError) as raised:
            await fs.create_watcher(CreateWatcherRequest(path=str(tmp_path / "missing")))
        assert raised.value.code == Code.NOT_FOUND
        with pytest.raises(ConnectError) as raised:
            await fs.create_watcher(CreateWatcherRequest(path=str(tmp_path / "f.txt")))
        assert raised.value.code == Code.INVALID_ARGUMENT
        with pytest.raises(ConnectError) as raised:
            await anext(fs.watch_dir(WatchDirRequest(path=str(tmp_path / "missing"))))
        assert raised.value.code == Code.NOT_FOUND


async def test_uploads_give_e2b_envds_watch_events(envd: Envd, tmp_path: Path) -> None:
    """E2B's envd creates the target, chowns it to the user, then writes: CREATE, CHMOD,
    WRITE for a new file (no WRITE when empty); CHMOD, WRITE for one it replaces."""
    (tmp_path / "old.txt").write_bytes(b"old")
    async with FilesystemClient(envd.url, codec=proto_json_codec(), send_compression=None) as fs:
        stream = fs.watch_dir(WatchDirRequest(path=str(tmp_path)))
        assert (await anext(stream)).event.field == "start"
        async with httpx.AsyncClient() as http:
            for name, data in (
                ("new.txt", b"data"),
                ("old.txt", b"data"),
                ("empty.txt", b""),
                ("end.txt", b"data"),
            ):
                written = await http.post(
                    f"{envd.url}/files",
                    params={"path": str(tmp_path / name)},
                    files={"file": (name, data)},
                )
                assert written.status_code == 200, written.text
        seen: list[tuple[str, Any]] = []
        async with asyncio.timeout(20):
            while ("end.txt", EventType.WRITE) not in seen:
                response = await anext(stream)
                if response.event.field == "filesystem":
                    seen.append((response.event.value.name, response.event.value.type))
        await stream.aclose()
    assert seen == [
        ("new.txt", EventType.CREATE),
        ("new.txt", EventType.CHMOD),
        ("new.txt", EventType.WRITE),
        ("old.txt", EventType.CHMOD),
        ("old.txt", EventType.WRITE),
        ("empty.txt", EventType.CREATE),
        ("empty.txt", EventType.CHMOD),
        ("end.txt", EventType.CREATE),
        ("end.txt", EventType.CHMOD),
        ("end.txt", EventType.WRITE),
    ]


# -- /files of unknown size ----------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/proc/version", "/proc/self/status", "/sys/devices/system/cpu/online"]
)
def test_files_without_a_size_are_read_to_eof(envd: Envd, path: str) -> None:
    """procfs says 0 bytes and sysfs a page, whatever they hold: read until EOF."""
    read = httpx.get(f"{envd.url}/files", params={"path": path}, headers={"Range": "bytes=0-1"})
    assert read.status_code == 200, read.text
    assert "content-length" not in read.headers
    if path != "/proc/self/status":  # envd's own status, not this process's
        assert read.content == Path(path).read_bytes()
    assert read.content.strip()


def test_files_reads_a_pipe_until_its_writer_closes(envd: Envd, tmp_path: Path) -> None:
    fifo = tmp_path / "feed"
    os.mkfifo(fifo)

    def write_slowly() -> None:
        with open(fifo, "wb", buffering=0) as out:  # waits for envd to open it
            for line in (b"one\n", b"two\n"):
                time.sleep(0.2)
                out.write(line)

    writer = threading.Thread(target=write_slowly, daemon=True)
    writer.start()
    read = httpx.get(f"{envd.url}/files", params={"path": str(fifo)}, timeout=30)
    writer.join(10)
    assert read.status_code == 200, read.text
    assert read.content == b"one\ntwo\n"


# -- processes: PTY, StreamInput ---------------------------------------------------------


async def test_pty_kill(client: ProcessClient) -> None:
    stream = client.start(
        StartRequest(
            process=ProcessConfig(cmd="/bin/bash", args=["-i", "-l"]),
            pty=PTY(size=PTY.Size(cols=80, rows=24)),
        )
    )
    selector = by_pid((await anext(stream)).event.event.value.pid)
    await client.send_input(
        SendInputRequest(
            process=selector, input=ProcessInput(input=Oneof("pty", b"echo ready-$((6*7))\r"))
        )
    )
    await read_pty_until(stream, "ready-42")
    await client.send_signal(SendSignalRequest(process=selector, signal=Signal.SIGKILL))
    end = end_of(await collect(stream))
    assert (end.exit_code, end.exited, end.status) == (-1, False, "signal: killed")


async def test_stream_input(client: ProcessClient) -> None:
    stream = client.start(
        StartRequest(process=ProcessConfig(cmd="/bin/cat"), stdin=True, tag="streamer")
    )
    pid = (await anext(stream)).event.event.value.pid
    listed = await client.list(ListRequest())
    assert [p.tag for p in listed.processes if p.pid == pid] == ["streamer"]
    selector = ProcessSelector(selector=Oneof("tag", "streamer"))

    async def inputs() -> AsyncIterator[StreamInputRequest]:
        yield StreamInputRequest(
            event=Oneof("start", StreamInputRequest.StartEvent(process=selector))
        )
        for word in (b"one ", b"two\n"):
            data = StreamInputRequest.DataEvent(input=ProcessInput(input=Oneof("stdin", word)))
            yield StreamInputRequest(event=Oneof("data", data))
        yield StreamInputRequest(event=Oneof("keepalive", StreamInputRequest.KeepAlive()))

    await client.stream_input(inputs())
    await client.close_stdin(CloseStdinRequest(process=selector))
    events = await collect(stream)
    assert output(events, "stdout") == b"one two\n"
    assert end_of(events).exit_code == 0


async def test_process_umask_and_groups(client: ProcessClient) -> None:
    events = await collect(client.start(bash("umask; id -G")))
    lines = output(events, "stdout").decode().split("\n")
    assert lines[0] == "0022"
    expected = sorted(os.getgrouplist(pwd.getpwuid(os.geteuid()).pw_name, os.getegid()))
    assert sorted(int(g) for g in lines[1].split()) == sorted(set(expected))


# -- metrics, version, robustness ----------------------------------------------------------


def test_metrics_and_version(envd: Envd) -> None:
    first = httpx.get(f"{envd.url}/metrics").json()
    metrics = httpx.get(f"{envd.url}/metrics").json()
    assert (
        set(metrics)
        == set(first)
        == {
            "ts",
            "cpu_count",
            "cpu_used_pct",
            "mem_total",
            "mem_used",
            "mem_cache",
            "mem_total_mib",
            "mem_used_mib",
            "disk_used",
            "disk_total",
        }
    )
    assert metrics["cpu_count"] == os.cpu_count()
    assert 0 <= metrics["cpu_used_pct"] <= 100
    assert 0 < metrics["mem_used"] < metrics["mem_total"]
    assert metrics["mem_total_mib"] == metrics["mem_total"] // (1024 * 1024)
    assert 0 < metrics["disk_used"] <= metrics["disk_total"]
    assert abs(metrics["ts"] - time.time()) < 3600
    health = httpx.get(f"{envd.url}/health")
    assert health.headers["x-envd-version"] == "0.6.4"


def test_malformed_requests_keep_envd_serving(envd: Envd) -> None:
    stream_headers = {"Content-Type": STREAM_CONTENT_TYPE}
    start = f"{envd.url}/process.Process/Start"
    for body in (
        b"\x00\x00\x00\x00\x10{",
        b"\x00\x00\x00\x00\x02{x",
        b"\x00\x00",
        b"\x00\x00\x00\x00\x02[]",
        b"\x80\x00\x00\x00\x02{}",  # a flag no client may set
    ):
        response = httpx.post(start, content=body, headers=stream_headers)
        frames = parse_envelopes(response.content)
        assert frames[-1][0] == 0x02
        assert frames[-1][1]["error"]["code"] == "invalid_argument", body
    unary = {"Content-Type": "application/json"}
    bad_json = httpx.post(f"{envd.url}/process.Process/List", content=b"{nope", headers=unary)
    assert (bad_json.status_code, bad_json.json()["code"]) == (400, "invalid_argument")
    bad_type = httpx.post(
        f"{envd.url}/filesystem.Filesystem/Stat", content=b'{"path": 5}', headers=unary
    )
    assert bad_type.json()["code"] == "invalid_argument"
    unknown = httpx.post(f"{envd.url}/process.Process/Nope", content=b"{}", headers=unary)
    assert (unknown.status_code, unknown.json()["code"]) == (404, "unimplemented")
    nowhere = httpx.get(f"{envd.url}/no/such/path")
    assert (nowhere.status_code, nowhere.json()["code"]) == (404, 404)
    try:
        huge = httpx.get(f"{envd.url}/health", headers={"X-Huge": "a" * 200_000})
        assert huge.status_code >= 400
    except httpx.TransportError:
        pass  # the server may close before reading the whole header block
    assert httpx.get(f"{envd.url}/health").status_code == 204
    assert envd.proc.poll() is None


# -- the unmodified E2B SDK against envd -----------------------------------------------


def test_unmodified_e2b_sdk(envd: Envd, tmp_path: Path) -> None:
    # The SDK's own sync clients, pointed straight at envd (no control plane in between).
    url, root = envd.url, str(tmp_path)
    config = ConnectionConfig(api_key="unused", request_timeout=20)
    api = get_envd_api(config, url)
    version = Version("0.6.4")
    fs = Filesystem(url, version, config, api)
    fs.write(root + "/a.txt", "text")
    assert fs.read(root + "/a.txt") == "text"
    infos = fs.write_files(
        [{"path": root + "/m/b.txt", "data": "B"}, {"path": root + "/m/c.bin", "data": b"C"}]
    )
    assert [i.name for i in infos] == ["b.txt", "c.bin"]
    info = fs.write(root + "/s.bin", io.BytesIO(b"streamed"), metadata={"Team": "x"})
    assert info.metadata == {"team": "x"}
    assert fs.get_info(root + "/s.bin").metadata == {"team": "x"}
    fs.write(root + "/g.txt", "z" * 10000, gzip=True)
    assert fs.read(root + "/g.txt", gzip=True) == "z" * 10000
    assert bytes(fs.read(root + "/s.bin", format="bytes")) == b"streamed"
    with pytest.raises(FileNotFoundException):
        fs.read(root + "/missing")
    watcher = fs.watch_dir(root, recursive=True)
    fs.write(root + "/m/w.txt", "w")
    events: set[tuple[str, str]] = set()
    for _ in range(100):
        events |= {(e.name, e.type.value) for e in watcher.get_new_events()}
        if ("m/w.txt", "write") in events:
            break
        time.sleep(0.05)
    watcher.stop()
    assert {("m/w.txt", "create"), ("m/w.txt", "write")} <= events, events

    commands = Commands(url, config, version, api)
    assert commands.run("echo hi").stdout == "hi\n"
    handle = commands.run("cat", background=True, stdin=True)
    commands.send_stdin(handle.pid, "piped\n")
    commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "piped\n"
    assert commands.kill(2**31 - 1) is False

    pty = Pty(url, config, version, api)
    out: list[bytes] = []
    terminal = pty.create(PtySize(rows=24, cols=80))
    pty.resize(terminal.pid, PtySize(rows=33, cols=111))
    pty.send_stdin(terminal.pid, b"stty size; exit 0\n")
    result = terminal.wait(on_pty=lambda data: out.append(bytes(data)))
    assert b"33 111" in b"".join(out), out
    assert result.exit_code == 0
