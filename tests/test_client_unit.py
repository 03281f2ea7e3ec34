"""``agentenv.client``'s HTTP layer against a stand-in server (``httpx.MockTransport``, no
VMs): status mapping and error parsing, transport failures, paging, query and path
quoting, and that importing the client leaves the SDK unimported."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
from collections.abc import Callable, Iterator

import httpx
import pytest

from agentenv.client import (
    AgentEnv,
    AgentEnvError,
    AsyncAgentEnv,
    AuthError,
    ConflictError,
    Connection,
    InvalidRequestError,
    NoAnswerError,
    NotFoundError,
    NotSupportedError,
    UnreachableError,
)
from agentenv.limits import MAX_FORK_CHILDREN, MAX_REFRESH_DURATION_S
from tests.helpers import ROOT

SERVER = "http://aenv.test"
Handler = Callable[[httpx.Request], httpx.Response]


def detail(sandbox_id: str, **extra: object) -> dict[str, object]:
    """A sandbox as ``GET /v2/sandboxes`` lists it."""
    return {
        "templateID": "base",
        "sandboxID": sandbox_id,
        "clientID": "local",
        "startedAt": "2030-01-01T00:00:00Z",
        "endAt": "2030-01-01T00:05:00Z",
        "cpuCount": 2,
        "memoryMB": 512,
        "diskSizeMB": 1024,
        "state": "running",
        "envdVersion": "0.2.0",
        "metadata": {},
        **extra,
    }


def snapshot(snapshot_id: str) -> dict[str, object]:
    return {"snapshotID": snapshot_id, "names": [], "sandboxID": "sb", "createdAt": None}


class Recorder:
    """The requests a handler saw, in order."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.handler(request)


def client_for(handler: Handler) -> AgentEnv:
    connection = Connection(server=SERVER, api_key="key", sandbox_url=SERVER)
    return AgentEnv(connection=connection, transport=httpx.MockTransport(handler))


@pytest.fixture
def answer() -> Iterator[Callable[[httpx.Response], AgentEnv]]:
    """A client whose every request gets the given response."""
    clients: list[AgentEnv] = []

    def make(response: httpx.Response) -> AgentEnv:
        clients.append(client_for(lambda _: response))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


# -- error parsing and status mapping ----------------------------------------------------
@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, InvalidRequestError),
        (401, AuthError),
        (403, AuthError),
        (404, NotFoundError),
        (409, ConflictError),
        (501, NotSupportedError),
        (500, AgentEnvError),
        (503, AgentEnvError),
    ],
)
def test_error_statuses_map_to_classes(
    answer: Callable[[httpx.Response], AgentEnv], status: int, cls: type[AgentEnvError]
) -> None:
    client = answer(httpx.Response(status, json={"code": status, "message": "it went wrong"}))
    with pytest.raises(AgentEnvError) as raised:
        client.get("sb")
    assert type(raised.value) is cls
    assert raised.value.status == status
    assert raised.value.message == "it went wrong"
    assert str(raised.value) == f"{status}: it went wrong"


def test_error_without_agentenv_body_keeps_the_text_or_reason(
    answer: Callable[[httpx.Response], AgentEnv],
) -> None:
    with pytest.raises(AgentEnvError) as html:
        answer(httpx.Response(502, text="  <html>bad gateway</html>\n")).health()
    assert html.value.message == "<html>bad gateway</html>"
    with pytest.raises(AgentEnvError) as empty:
        answer(httpx.Response(502)).health()
    assert empty.value.message == "Bad Gateway"
    with pytest.raises(NotFoundError) as other_json:
        answer(httpx.Response(404, json={"detail": "Not Found"})).health()
    assert other_json.value.message == '{"detail":"Not Found"}'


def test_a_success_that_is_not_the_api_is_reported_as_such(
    answer: Callable[[httpx.Response], AgentEnv],
) -> None:
    with pytest.raises(AgentEnvError) as raised:
        answer(httpx.Response(200, text="<html>a web page</html>")).health()
    assert type(raised.value) is AgentEnvError and raised.value.status == 200
    assert f"unexpected response from {SERVER}/health" in raised.value.message
    assert "agentenv server" in raised.value.message


@pytest.mark.parametrize(
    ("failure", "cls"),
    [
        (httpx.ConnectError("[Errno 111] Connection refused"), UnreachableError),
        (httpx.ConnectTimeout("timed out"), UnreachableError),
        (httpx.UnsupportedProtocol("no ftp"), UnreachableError),
        (httpx.ReadTimeout("timed out"), NoAnswerError),
        (httpx.RemoteProtocolError("peer closed"), AgentEnvError),
    ],
)
def test_transport_failures(failure: httpx.TransportError, cls: type[AgentEnvError]) -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise failure

    with client_for(fail) as client, pytest.raises(AgentEnvError) as raised:
        client.pause("sb")
    assert type(raised.value) is cls
    assert raised.value.status is None
    assert raised.value.__cause__ is failure
    assert f"{SERVER}/sandboxes/sb/pause" in raised.value.message


def test_missing_ok_decides_whether_a_delete_of_nothing_raises(
    answer: Callable[[httpx.Response], AgentEnv],
) -> None:
    client = answer(httpx.Response(404, json={"code": 404, "message": "no such thing"}))
    assert client.kill("sb") is False
    assert client.delete_snapshot("snap") is False
    assert client.delete_template("tpl") is False
    for delete in (client.kill, client.delete_snapshot, client.delete_template):
        with pytest.raises(NotFoundError, match="no such thing"):
            delete("x", missing_ok=False)
    # Other failures are never swallowed.
    conflict = answer(httpx.Response(409, json={"code": 409, "message": "built in"}))
    with pytest.raises(ConflictError):
        conflict.delete_template("base")


# -- requests: paths, queries, bodies ----------------------------------------------------
def test_ids_and_names_are_one_quoted_path_segment() -> None:
    recorder = Recorder(lambda _: httpx.Response(204))
    with client_for(recorder) as client:
        client.kill("a/b c")
        client.delete_snapshot("team/snap:1")
        client.delete_template("registry:5000/team/app:1")
        client.set_timeout("../health", 30)
    assert [r.url.raw_path.decode() for r in recorder.requests] == [
        "/sandboxes/a%2Fb%20c",
        "/snapshots/team%2Fsnap%3A1",
        "/templates/registry%3A5000%2Fteam%2Fapp%3A1",
        "/sandboxes/..%2Fhealth/timeout",
    ]
    assert all(r.headers["X-API-Key"] == "key" for r in recorder.requests)
    assert json.loads(recorder.requests[-1].content) == {"timeout": 30}


def test_update_network_sends_the_sdks_body() -> None:
    recorder = Recorder(lambda _: httpx.Response(204))
    with client_for(recorder) as client:
        client.update_network("sb", allow_out=["1.1.1.1"], deny_out=["0.0.0.0/0"])
        client.update_network("sb", allow_internet_access=False, dns_servers=[])
    assert [(r.method, r.url.raw_path.decode()) for r in recorder.requests] == [
        ("PUT", "/sandboxes/sb/network"),
        ("PUT", "/sandboxes/sb/network"),
    ]
    assert [json.loads(r.content) for r in recorder.requests] == [
        {"allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"]},
        {"dnsServers": [], "allow_internet_access": False},
    ]


def test_sandbox_listing_follows_pages_with_its_filters() -> None:
    pages = {
        None: ([detail("a"), detail("b")], "t1"),
        "t1": ([detail("c")], "t2"),
        "t2": ([], None),
    }

    def serve(request: httpx.Request) -> httpx.Response:
        items, token = pages[request.url.params.get("nextToken")]
        headers = {"X-Next-Token": token} if token else {}
        return httpx.Response(200, json=items, headers=headers)

    recorder = Recorder(serve)
    metadata = {"suite": "cli", "odd key": "a=b&c%d"}
    with client_for(recorder) as client:
        listed = client.list_sandboxes(state="running", metadata=metadata)
    assert [s.sandbox_id for s in listed] == ["a", "b", "c"]
    assert [r.url.path for r in recorder.requests] == ["/v2/sandboxes"] * 3
    for request in recorder.requests:
        assert request.url.params["state"] == "running"
        assert request.url.params["limit"] == "1000"
        # Decoded as the server decodes it: the pairs survive `=`, `&` and `%`.
        wanted = {
            urllib.parse.unquote(k): urllib.parse.unquote(v)
            for k, v in urllib.parse.parse_qsl(request.url.params["metadata"])
        }
        assert wanted == metadata
    assert [r.url.params.get("nextToken") for r in recorder.requests] == [None, "t1", "t2"]


def test_one_page_and_no_filters() -> None:
    recorder = Recorder(lambda _: httpx.Response(200, json=[detail("a")]))
    with client_for(recorder) as client:
        page = client.list_sandboxes_page(limit=1)
    assert [s.sandbox_id for s in page.items] == ["a"] and page.next_token is None
    assert dict(recorder.requests[0].url.params) == {"limit": "1"}


def test_snapshot_listing_follows_pages() -> None:
    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.params.get("nextToken") == "more":
            return httpx.Response(200, json=[snapshot("s2")])
        return httpx.Response(200, json=[snapshot("s1")], headers={"X-Next-Token": "more"})

    recorder = Recorder(serve)
    with client_for(recorder) as client:
        every = list(client.iter_snapshots(sandbox="sb", page_size=1))
    assert [s.snapshot_id for s in every] == ["s1", "s2"]
    assert [dict(r.url.params) for r in recorder.requests] == [
        {"sandboxID": "sb", "limit": "1"},
        {"sandboxID": "sb", "limit": "1", "nextToken": "more"},
    ]


def test_resume_says_whether_the_sandbox_was_paused() -> None:
    created = {"templateID": "base", "sandboxID": "sb", "envdVersion": "0.2.0"}
    for status, resumed in ((201, True), (200, False)):

        def connect(request: httpx.Request, status: int = status) -> httpx.Response:
            return httpx.Response(status, json=created)

        recorder = Recorder(connect)
        with client_for(recorder) as client:
            result = client.resume("sb", timeout=60)
        assert result.resumed is resumed and result.sandbox.sandbox_id == "sb"
        assert recorder.requests[0].url.path == "/v2/sandboxes/sb/connect"
        assert json.loads(recorder.requests[0].content) == {"timeout": 60}


def test_start_sends_the_create_body() -> None:
    created = {"templateID": "base", "sandboxID": "sb", "envdVersion": "0.2.0"}
    recorder = Recorder(lambda _: httpx.Response(201, json=created))
    with client_for(recorder) as client:
        started = client.start("base", timeout=60, metadata={"a": "1"}, envs={"B": "2"})
    assert started.sandbox_id == "sb" and started.envd_access_token is None
    assert json.loads(recorder.requests[0].content) == {
        "templateID": "base",
        "metadata": {"a": "1"},
        "envVars": {"B": "2"},
        "timeout": 60,
    }


def test_fork_results_keep_each_childs_sandbox_or_error() -> None:
    body = [
        {"sandbox": {"templateID": "base", "sandboxID": "c1", "envdVersion": "0.2.0"}},
        {"error": {"code": 503, "message": "no room"}},
    ]
    with client_for(lambda _: httpx.Response(201, json=body)) as client:
        results = client.fork_results("sb", 2)
    assert results[0].sandbox is not None and results[0].sandbox.sandbox_id == "c1"
    assert results[1].error is not None and results[1].error.message == "no room"


def test_limits_are_checked_before_anything_is_sent() -> None:
    recorder = Recorder(lambda _: httpx.Response(500))
    with client_for(recorder) as client:
        for count in (0, MAX_FORK_CHILDREN + 1):
            with pytest.raises(ValueError, match=str(MAX_FORK_CHILDREN)):
                client.fork_results("sb", count)
        with pytest.raises(ValueError, match=str(MAX_REFRESH_DURATION_S)):
            client.refresh("sb", MAX_REFRESH_DURATION_S + 1)
    assert recorder.requests == []


async def test_async_client_pages_and_maps_errors_the_same() -> None:
    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/sandboxes/gone/pause":
            return httpx.Response(404, json={"code": 404, "message": "gone"})
        if request.url.params.get("nextToken") == "t":
            return httpx.Response(200, json=[detail("b")])
        return httpx.Response(200, json=[detail("a")], headers={"X-Next-Token": "t"})

    connection = Connection(server=SERVER, api_key="key", sandbox_url=SERVER)
    async with AsyncAgentEnv(connection=connection, transport=httpx.MockTransport(serve)) as c:
        assert [s.sandbox_id for s in await c.list_sandboxes()] == ["a", "b"]
        with pytest.raises(NotFoundError, match="gone"):
            await c.pause("gone")
        assert await c.kill("gone") is True  # the stand-in deletes anything


def imported_by(module: str) -> set[str]:
    probe = f"import sys, {module}; print(' '.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


def test_importing_the_client_leaves_the_sdk_unimported() -> None:
    # The aenv CLI is built on the client; the SDK would add most of a second to every
    # command that talks to the server.
    assert "e2b" not in imported_by("agentenv.client")
    # Shell completion and --help do not even load the client (Pydantic, the models).
    cli = imported_by("agentenv.cli.main")
    assert not {"e2b", "pydantic", "agentenv.client"} & cli
