"""envd on the host: a real `python -m agentenv.envd` subprocess on a random localhost
port, driven by the generated Connect client (JSON codec, like the E2B SDK) and by raw
HTTP to check the wire framing the SDK depends on."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import pwd
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from connectrpc.code import Code
from connectrpc.codec import proto_json_codec
from connectrpc.errors import ConnectError
from protobuf import Oneof

from agentenv.envd.filesystem_service import go_mode_string
from agentenv.envd.gen.filesystem_connect import FilesystemClient
from agentenv.envd.gen.filesystem_pb import FileType, StatRequest
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
    UpdateRequest,
)
from agentenv.envd.processes import ProcessExit
from agentenv.envd.state import InitError, InitRequest

REPO = Path(__file__).resolve().parents[1]
STREAM_CONTENT_TYPE = "application/connect+json"
# envd's own environment carries these; user processes must not see them.
LEAKY_ENV = {"PYTHONPATH": "/envd-test-leak", "LD_LIBRARY_PATH": "/envd-test-leak"}


class Envd:
    """One envd subprocess on 127.0.0.1."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port: int = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **LEAKY_ENV}
        env["PYTHONPATH"] = f"{REPO}{os.pathsep}{LEAKY_ENV['PYTHONPATH']}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentenv.envd",
                "--port",
                str(self.port),
                "--host",
                "127.0.0.1",
                "--no-system-changes",
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
    assert httpx.post(f"{envd.url}/init", content=b"{nope").status_code == 400
    bad_user = httpx.post(f"{envd.url}/init", json={"defaultUser": "no-such-user-envd"})
    assert bad_user.status_code == 400
    assert "no-such-user-envd" in bad_user.json()["message"]
    assert httpx.post(f"{envd.url}/init", json={"timestamp": "yesterday"}).status_code == 400
    assert httpx.post(f"{envd.url}/init", json={"seed": "***"}).status_code == 400


async def test_init_env_vars_reach_processes(envd: Envd, client: ProcessClient) -> None:
    body = {
        "envVars": {"ENVD_TEST_VAR": "from-init"},
        "timestamp": "2026-01-02T03:04:05.123456789Z",
        "seed": base64.b64encode(b"entropy").decode(),
    }
    async with httpx.AsyncClient(base_url=envd.url) as http:
        assert (await http.post("/init", json=body)).status_code == 204
        # Calling it again (as after every snapshot restore) is fine and merges.
        assert (await http.post("/init", json={"envVars": {"OTHER": "x"}})).status_code == 204
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
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/init", json={"accessToken": "s3cret"})).status_code == 204
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


def test_sigterm_exits_cleanly(fresh_envd: Envd) -> None:
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
