"""Access tokens and bad input: what the SDK sees, and what raw HTTP clients get.

Raw requests go to the server exactly as the SDK sends them (option A routing: the
``E2b-Sandbox-Id`` header), minus whatever is under test.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import E2B, Sandbox, SandboxNotFoundException, SandboxNotRunningException

from tests.helpers import ServerProcess, envelope, read_envelopes

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def pair(e2b: E2B) -> Iterator[tuple[Sandbox, Sandbox]]:
    a = e2b.Sandbox.create(timeout=300, metadata={"suite": "e2b-security"})
    b = e2b.Sandbox.create(timeout=300, metadata={"suite": "e2b-security"})
    yield a, b
    a.kill()
    b.kill()


def token_of(server: ServerProcess, sandbox_id: str) -> str:
    with server.client() as c:
        detail = c.get(f"/sandboxes/{sandbox_id}").json()
    token = detail.get("envdAccessToken")
    assert isinstance(token, str) and token
    return token


def envd(
    server: ServerProcess,
    sandbox_id: str,
    path: str,
    *,
    token: str | None = None,
    json_body: object = None,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> httpx.Response:
    """One request to a sandbox's envd through the server's proxy."""
    sent = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
    if token is not None:
        sent["X-Access-Token"] = token
    if json_body is not None:
        content = json.dumps(json_body).encode()
        sent["Content-Type"] = "application/json"
    sent.update(headers or {})
    return httpx.request(
        method, f"{server.url}{path}", content=content, headers=sent, timeout=60, trust_env=False
    )


def stream_request(
    server: ServerProcess, sandbox_id: str, path: str, body: bytes, token: str
) -> httpx.Response:
    return envd(
        server,
        sandbox_id,
        path,
        token=token,
        content=body,
        headers={"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"},
    )


def assert_still_serving(server: ServerProcess, sandbox: Sandbox) -> None:
    assert httpx.get(f"{server.url}/health", trust_env=False).json()["status"] in ("ok",)
    assert sandbox.commands.run("echo alive").stdout == "alive\n"
    assert sandbox.files.exists("/home/user")


# -- tokens --------------------------------------------------------------------------------
def test_sdk_sandboxes_are_secured(
    e2b_server: ServerProcess, pair: tuple[Sandbox, Sandbox]
) -> None:
    a, b = pair
    token_a, token_b = token_of(e2b_server, a.sandbox_id), token_of(e2b_server, b.sandbox_id)
    assert token_a != token_b
    list_rpc = "/process.Process/List"
    stat_rpc = "/filesystem.Filesystem/Stat"

    # The SDK itself gets through: it sends the token create returned.
    assert a.commands.run("true").exit_code == 0

    for token in (None, "", "not-the-token", token_b):
        for path, body in ((list_rpc, {}), (stat_rpc, {"path": "/home/user"})):
            response = envd(e2b_server, a.sandbox_id, path, token=token, json_body=body)
            assert response.status_code == 401, (path, token, response.text)
            assert response.json()["message"]

    started = stream_request(
        e2b_server,
        a.sandbox_id,
        "/process.Process/Start",
        envelope({"process": {"cmd": "/bin/true"}}),
        token_b,
    )
    assert started.status_code == 401

    files = envd(e2b_server, a.sandbox_id, "/files?path=/home/user/.bashrc", method="GET")
    assert files.status_code == 401
    files_b = envd(
        e2b_server, a.sandbox_id, "/files?path=/home/user/.bashrc", method="GET", token=token_b
    )
    assert files_b.status_code == 401
    upload = envd(
        e2b_server,
        a.sandbox_id,
        "/files?path=/home/user/planted",
        content=b"x",
        headers={"Content-Type": "application/octet-stream"},
    )
    assert upload.status_code == 401
    assert not a.files.exists("/home/user/planted")

    # The right token works, and /health needs none.
    ok = envd(e2b_server, a.sandbox_id, list_rpc, token=token_a, json_body={})
    assert ok.status_code == 200, ok.text
    assert isinstance(ok.json().get("processes", []), list)
    assert envd(e2b_server, a.sandbox_id, "/health", method="GET").status_code in (200, 204)


def test_v2_create_sends_no_secure_flag_and_gets_a_token(
    e2b: E2B, monkeypatch: pytest.MonkeyPatch
) -> None:
    """V2 create has no ``secure`` field ("always secured"); the server must answer it
    with an ``envdAccessToken`` all the same."""
    seen: list[tuple[str, bytes, bytes]] = []
    original = httpx.Client.send

    def recording_send(self: httpx.Client, request: httpx.Request, **kwargs: Any) -> Any:
        response = original(self, request, **kwargs)
        if request.url.path == "/v2/sandboxes" and request.method == "POST":
            response.read()
            seen.append((request.url.path, request.content, response.content))
        return response

    monkeypatch.setattr(httpx.Client, "send", recording_send)
    sandbox = e2b.Sandbox.create(timeout=60)
    try:
        assert len(seen) == 1
        sent, answered = json.loads(seen[0][1]), json.loads(seen[0][2])
        assert "secure" not in sent
        assert sent["templateID"] == "base"
        assert isinstance(answered["envdAccessToken"], str) and answered["envdAccessToken"]
        assert answered["sandboxID"] == sandbox.sandbox_id
    finally:
        sandbox.kill()


def test_init_is_not_reachable_through_the_proxy(
    e2b_server: ServerProcess, pair: tuple[Sandbox, Sandbox]
) -> None:
    a, _ = pair
    token = token_of(e2b_server, a.sandbox_id)
    hijack = envd(e2b_server, a.sandbox_id, "/init", token=token, json_body={"accessToken": "mine"})
    assert hijack.status_code == 403
    assert a.commands.run("true").exit_code == 0


# -- unknown sandboxes ---------------------------------------------------------------------
def test_unknown_sandbox(e2b: E2B, e2b_server: ServerProcess) -> None:
    with pytest.raises(SandboxNotFoundException):
        e2b.Sandbox.connect("inosuchsandbox")
    with pytest.raises(SandboxNotFoundException):
        e2b.Sandbox.get_info("inosuchsandbox")
    assert e2b.Sandbox.kill("inosuchsandbox") is False

    response = envd(e2b_server, "inosuchsandbox", "/process.Process/List", json_body={})
    assert response.status_code == 502
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["code"] == 502 and "was not found" in body["message"]


def test_calls_on_a_killed_sandbox(e2b: E2B) -> None:
    doomed = e2b.Sandbox.create(timeout=60)
    doomed.kill()
    with pytest.raises(SandboxNotRunningException):
        doomed.commands.run("true")
    with pytest.raises(SandboxNotRunningException):
        doomed.files.read("/home/user/.bashrc")
    assert doomed.is_running() is False


# -- malformed requests --------------------------------------------------------------------
@pytest.mark.parametrize("routed", [False, True], ids=["control-plane", "proxy"])
def test_huge_header_is_refused(
    e2b_server: ServerProcess, pair: tuple[Sandbox, Sandbox], routed: bool
) -> None:
    a, _ = pair
    headers = {"X-Padding": "a" * (100 * 1024)}
    if routed:
        headers["E2b-Sandbox-Id"] = a.sandbox_id
    for _ in range(3):
        response = httpx.get(
            f"{e2b_server.url}/health", headers=headers, trust_env=False, timeout=30
        )
        assert response.status_code == 431, response.status_code
        assert response.json()["code"] == 431


def test_server_survives_huge_headers(
    e2b_server: ServerProcess, pair: tuple[Sandbox, Sandbox]
) -> None:
    a, _ = pair
    for size in (100 * 1024, 1024 * 1024):
        for target in ({}, {"E2b-Sandbox-Id": a.sandbox_id}):
            with contextlib.suppress(httpx.TransportError):
                httpx.get(
                    f"{e2b_server.url}/health",
                    headers={"X-Padding": "a" * size, **target},
                    trust_env=False,
                    timeout=30,
                )
    assert_still_serving(e2b_server, a)


def test_malformed_connect_requests(
    e2b_server: ServerProcess, pair: tuple[Sandbox, Sandbox]
) -> None:
    a, _ = pair
    token = token_of(e2b_server, a.sandbox_id)
    start = "/process.Process/Start"

    def connect_error(response: httpx.Response) -> dict[str, object]:
        """The Connect error of a streaming call: a non-200 JSON error, or a 200 whose
        end-stream envelope carries it."""
        if response.status_code != 200:
            error = response.json()
        else:
            assert response.headers["content-type"] == "application/connect+json"
            frames = list(read_envelopes(response.content))
            assert frames and frames[-1][0] == 2, frames
            assert all("event" not in message for _, message in frames[:-1]), frames
            error = frames[-1][1]["error"]
        assert isinstance(error, dict)
        assert isinstance(error["code"], str) and error["message"]
        return error

    good = envelope({"process": {"cmd": "/bin/true"}})
    # Length prefix claims more bytes than the body has.
    truncated = struct.pack(">BI", 0, 1000) + good[5:]
    assert connect_error(stream_request(e2b_server, a.sandbox_id, start, truncated, token))[
        "code"
    ] in ("invalid_argument", "internal", "unknown")
    # A frame whose payload is not JSON.
    garbage = struct.pack(">BI", 0, 9) + b"not json!"
    assert (
        connect_error(stream_request(e2b_server, a.sandbox_id, start, garbage, token))["code"]
        == "invalid_argument"
    )
    # A frame header cut short, and a compressed flag nobody negotiated.
    for body in (b"\x00\x00", struct.pack(">BI", 1, 2) + b"{}"):
        error = connect_error(stream_request(e2b_server, a.sandbox_id, start, body, token))
        assert error["code"] in ("invalid_argument", "internal", "unimplemented")
    # Unary call with a body that is not JSON, or JSON of the wrong shape.
    unary = envd(
        e2b_server,
        a.sandbox_id,
        "/filesystem.Filesystem/Stat",
        token=token,
        content=b"\xff\xfe{",
        headers={"Content-Type": "application/json"},
    )
    assert unary.status_code == 400
    assert unary.json()["code"] == "invalid_argument"
    wrong = envd(
        e2b_server, a.sandbox_id, "/filesystem.Filesystem/Stat", token=token, json_body=[1, 2]
    )
    assert wrong.status_code == 400
    assert wrong.json()["code"] == "invalid_argument"
    unknown = envd(
        e2b_server, a.sandbox_id, "/process.Process/NoSuchMethod", token=token, json_body={}
    )
    assert unknown.status_code == 404
    assert unknown.json()["code"] == "unimplemented"

    assert_still_serving(e2b_server, a)
