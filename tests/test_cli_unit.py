"""``aenv`` on ``agentenv.client`` against a stand-in server (``httpx.MockTransport``, no
VMs): what the commands print, and how the client's failures become one line and an exit
code."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.cli import api
from agentenv.cli.errors import ExitCode, client_error
from agentenv.cli.main import main
from agentenv.client import (
    AgentEnv,
    AgentEnvError,
    AuthError,
    ConflictError,
    NoAnswerError,
    NotFoundError,
    NotSupportedError,
    UnreachableError,
)
from agentenv.limits import MAX_FORK_CHILDREN

SERVER = "http://aenv.test"
Route = Callable[[httpx.Request], httpx.Response]

SANDBOX = {
    "templateID": "base",
    "sandboxID": "sb1",
    "clientID": "local",
    "startedAt": "2030-01-01T00:00:00Z",
    "endAt": "2030-01-01T00:05:00Z",
    "cpuCount": 2,
    "memoryMB": 512,
    "diskSizeMB": 1024,
    "state": "running",
    "envdVersion": "0.2.0",
    "metadata": {"suite": "unit"},
    "lineage": {"sourceID": "base", "children": []},
}
CREATED = {
    "templateID": "base",
    "sandboxID": "sb1",
    "clientID": "local",
    "envdVersion": "0.2.0",
    "alias": None,
    "envdAccessToken": "token",
    "trafficAccessToken": None,
    "domain": None,
}


def error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"code": status, "message": message})


class StandIn:
    """A server answering ``(method, path)`` routes; any other request is a 404."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Route] = {}
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        route = self.routes.get((request.method, request.url.path))
        if route is None:
            return error(404, f"sandbox {request.url.path.split('/')[2]!r} not found")
        return route(request)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[StandIn]:
    stand_in = StandIn()
    monkeypatch.setattr(
        api, "AgentEnv", functools.partial(AgentEnv, transport=httpx.MockTransport(stand_in))
    )
    for name in ("AENV_SERVER", "AENV_API_KEY", "E2B_API_KEY", "E2B_API_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AENV_SERVER", SERVER)
    monkeypatch.setenv("AENV_API_KEY", "the-key")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    yield stand_in


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("aenv: "), err
    return lines[0]


def test_ls_prints_what_the_server_sent_and_passes_the_filters(
    server: StandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    server.routes["GET", "/v2/sandboxes"] = lambda _: httpx.Response(200, json=[SANDBOX])
    code, out, _ = run(capsys, "ls", "--state", "running", "-m", "suite=unit", "-o", "json")
    assert code == 0
    assert json.loads(out) == [SANDBOX]
    params = server.requests[0].url.params
    assert params["state"] == "running" and params["metadata"] == "suite=unit"
    assert server.requests[0].headers["X-API-Key"] == "the-key"


def test_start_detached_prints_the_id_or_the_create_answer(
    server: StandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    server.routes["POST", "/v2/sandboxes"] = lambda _: httpx.Response(201, json=CREATED)
    assert run(capsys, "start", "base", "-d", "-t", "60")[:2] == (0, "sb1\n")
    code, out, _ = run(capsys, "start", "base", "-d", "-o", "json")
    assert code == 0 and json.loads(out) == CREATED
    assert json.loads(server.requests[0].content)["timeout"] == 60


def test_resume_reports_whether_it_resumed(
    server: StandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    server.routes["POST", "/v2/sandboxes/sb1/connect"] = lambda _: httpx.Response(200, json=CREATED)
    code, out, err = run(capsys, "resume", "sb1")
    assert (code, out) == (0, "sb1\n") and "already running" in err
    code, out, _ = run(capsys, "resume", "sb1", "-o", "json")
    assert json.loads(out) == {**CREATED, "resumed": False}


def test_fork_prints_started_children_and_fails_for_the_others(
    server: StandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    results = [
        {"sandbox": {k: v for k, v in CREATED.items() if v is not None}},
        {"error": {"code": 503, "message": "no room for child 2"}},
    ]
    server.routes["POST", "/sandboxes/sb1/fork"] = lambda _: httpx.Response(201, json=results)
    code, out, err = run(capsys, "fork", "sb1", "-n", "2")
    assert (code, out) == (1, "sb1\n")
    assert one_line(err) == "aenv: 1 of 2 children failed to start: no room for child 2"
    code, out, _ = run(capsys, "fork", "sb1", "-n", "2", "-o", "json")
    assert code == 1 and json.loads(out) == results  # no second JSON document


def test_fork_count_is_bounded_before_anything_is_sent(
    server: StandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "fork", "sb1", "-n", str(MAX_FORK_CHILDREN + 1))
    assert code == ExitCode.USAGE
    assert f"less than or equal to {MAX_FORK_CHILDREN}" in one_line(err)
    assert server.requests == []


def test_template_ls_merges_templates_health_and_snapshots(
    server: StandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    health = {
        "status": "ok",
        "version": "0.1.0",
        "vmm": "qemu",
        "accel": "tcg",
        "templates": {"base": "ready", "other": "building"},
        "sandboxes": 1,
    }
    template = {
        "templateID": "base",
        "buildID": "b1",
        "cpuCount": 2,
        "memoryMB": 512,
        "diskSizeMB": 1024,
        "aliases": ["base"],
        "names": ["base", "team/base"],
        "createdAt": "2030-01-01T00:00:00.123456Z",
        "updatedAt": "2030-01-01T00:00:00Z",
        "envdVersion": "0.2.0",
        "buildStatus": "ready",
    }
    snap = {"snapshotID": "s1", "names": ["named"], "sandboxID": "sb1", "createdAt": None}
    server.routes["GET", "/health"] = lambda _: httpx.Response(200, json=health)
    server.routes["GET", "/templates"] = lambda _: httpx.Response(200, json=[template])
    server.routes["GET", "/snapshots"] = lambda _: httpx.Response(200, json=[snap])
    code, out, _ = run(capsys, "template", "ls")
    assert code == 0
    assert json.loads(out) == [
        {
            "templateID": "base",
            "kind": "template",
            "state": "ready",
            "names": ["team/base"],
            "createdAt": "2030-01-01T00:00:00.123456Z",
        },
        {"templateID": "other", "kind": "template", "state": "building", "names": []},
        {
            "templateID": "s1",
            "kind": "snapshot",
            "state": "ready",
            "names": ["named"],
            "sandboxID": "sb1",
            "createdAt": None,
        },
    ]


def test_failures_are_one_line_with_the_documented_exit_code(
    server: StandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    server.routes["POST", "/sandboxes/sb1/pause"] = lambda _: error(409, "sb1 is paused")
    code, _, err = run(capsys, "pause", "sb1")
    assert code == ExitCode.CONFLICT
    assert one_line(err) == "aenv: cannot pause: sb1 is paused"
    code, _, err = run(capsys, "pause", "nope")
    assert code == ExitCode.NOT_FOUND and "'nope' not found" in one_line(err)

    # rm goes on past a missing id, and ends with the last failure's code.
    server.routes["DELETE", "/sandboxes/sb1"] = lambda _: httpx.Response(204)
    code, out, err = run(capsys, "rm", "nope", "sb1", "-o", "json")
    assert code == ExitCode.NOT_FOUND
    assert json.loads(out) == {"removed": ["sb1"], "failed": ["sandbox 'nope' not found"]}

    server.routes["GET", "/v2/sandboxes"] = lambda _: error(401, "invalid API key")
    code, out, err = run(capsys, "ls", "-o", "json")
    assert code == ExitCode.AUTH
    line = one_line(err)
    assert f"the server at {SERVER} rejected the API key (invalid API key)" in line
    assert json.loads(out) == {"error": line.removeprefix("aenv: "), "code": 3}


def test_auth_rejects_a_key_the_server_rejects_and_stores_nothing(
    server: StandIn, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    health = {"status": "ok", "version": "0.1.0", "vmm": "qemu", "accel": "tcg",
              "templates": {}, "sandboxes": 0}  # fmt: skip
    server.routes["GET", "/health"] = lambda _: httpx.Response(200, json=health)
    server.routes["GET", "/v2/sandboxes"] = lambda request: (
        httpx.Response(200, json=[])
        if request.headers.get("X-API-Key") == "good"
        else error(401, "invalid API key")
    )
    other = "http://elsewhere.test"
    code, _, err = run(capsys, "auth", "--server", other, "--key", "bad")
    assert code == ExitCode.AUTH and f"the server at {other} rejected" in one_line(err)
    assert not (tmp_path / "config" / "aenv" / "config.toml").exists()
    code, out, _ = run(capsys, "auth", "--server", other, "--key", "good", "-o", "json")
    assert code == 0 and json.loads(out)["version"] == "0.1.0"
    assert server.requests[-1].url.host == "elsewhere.test"


def test_health_shows_the_disk_and_why_the_node_is_degraded(
    server: StandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    health = {"status": "degraded", "version": "0.1.0", "vmm": "qemu", "accel": "tcg",
              "mode": "qemu/tcg", "modeReason": "vmm=auto: Firecracker needs hardware KVM",
              "templates": {}, "sandboxes": 0, "detail": "below its free-space floor",
              "disk": {"freeBytes": 1 << 29, "totalBytes": 8 << 30,
                       "floorBytes": 1 << 30}}  # fmt: skip
    server.routes["GET", "/health"] = lambda _: httpx.Response(200, json=health)
    code, out, _ = run(capsys, "health", "-o", "table")
    assert code == 0
    assert "0.5 GiB free of 8.0 GiB, floor 1.0 GiB" in out
    assert "degraded" in out and "below its free-space floor" in out
    assert "vmm=auto: Firecracker needs hardware KVM" in out


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (AuthError(403, "forbidden"), ExitCode.AUTH, "cannot pause: forbidden"),
        (NotFoundError(404, "no sb"), ExitCode.NOT_FOUND, "cannot pause: no sb"),
        (ConflictError(409, "paused"), ExitCode.CONFLICT, "cannot pause: paused"),
        (NotSupportedError(501, "no builds"), ExitCode.NOT_SUPPORTED, "cannot pause: no builds"),
        (AgentEnvError(500, "oops"), ExitCode.ERROR, "cannot pause: oops"),
        (AgentEnvError(None, "SDK said no"), ExitCode.ERROR, "cannot pause: SDK said no"),
    ],
)
def test_client_errors_become_cli_errors(error: AgentEnvError, code: int, message: str) -> None:
    cli_error = client_error(error, SERVER, "cannot pause")
    assert (cli_error.exit_code, cli_error.message) == (code, message)


def test_transport_failures_name_the_server() -> None:
    refused = httpx.ConnectError("[Errno 111] Connection refused")
    unreachable = UnreachableError(None, "cannot reach it")
    unreachable.__cause__ = refused
    cli_error = client_error(unreachable, SERVER, "cannot pause")
    assert cli_error.exit_code == ExitCode.UNREACHABLE
    assert cli_error.message.startswith(
        f"cannot reach the server at {SERVER} ([Errno 111] Connection refused); is it running?"
    )
    slow = NoAnswerError(None, "no answer")
    slow.__cause__ = httpx.ReadTimeout("read timed out")
    assert client_error(slow, SERVER).message == (
        f"the server at {SERVER} did not answer in time (read timed out)"
    )
    dropped = AgentEnvError(None, "request failed")
    dropped.__cause__ = httpx.RemoteProtocolError("peer closed")
    assert client_error(dropped, SERVER, "cannot fork").message == (
        f"connection to {SERVER} failed: peer closed"
    )


def test_an_unreachable_server_through_the_client(
    monkeypatch: pytest.MonkeyPatch, server: StandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused")

    monkeypatch.setattr(
        api, "AgentEnv", functools.partial(AgentEnv, transport=httpx.MockTransport(refuse))
    )
    code, out, err = run(capsys, "health", "-o", "json")
    assert code == ExitCode.UNREACHABLE and SERVER in one_line(err)
    assert json.loads(out)["code"] == 5
