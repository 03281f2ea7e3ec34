"""A hostile network client against the sandbox proxy and envd, with raw sockets.

The attack these reproduce: through the proxy, with only ``E2b-Sandbox-Id`` and a literal
path (``curl --path-as-is``), ``POST /files/../init`` with ``{"accessToken": "",
"defaultUser": "root"}`` switched a secured sandbox's token check off and made root its
default user; ``POST /files/../process.Process/Start`` then ran as uid 0. The proxy checked
the raw path, its HTTP client normalised it, and envd served /init without a token.
httpx normalises paths, so every request here is written byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import (
    ServerProcess,
    envelope,
    live_server,
    raw_http,
    run_command,
)

pytestmark = pytest.mark.vm

HIJACK = json.dumps({"accessToken": "", "defaultUser": "root"}).encode()
CONNECT_JSON = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}


@pytest.fixture(scope="module")
def secured(server: ServerProcess) -> Iterator[dict[str, Any]]:
    """A sandbox created the way SDK 2.51+ creates one (v2: secured)."""
    with server.client() as c:
        created = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
        assert created.status_code == 201, created.text
        body: dict[str, Any] = created.json()
        try:
            yield body
        finally:
            c.delete(f"/sandboxes/{body['sandboxID']}")


def _start_command(command: str) -> bytes:
    return envelope({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", command]}})


def test_the_reported_attack_is_refused(server: ServerProcess, secured: dict[str, Any]) -> None:
    """The two requests from the report, byte for byte: neither reaches envd."""
    sandbox_id, token = secured["sandboxID"], secured["envdAccessToken"]
    route = {"E2b-Sandbox-Id": sandbox_id}
    hijack = raw_http(
        server.port, "POST", "/files/../init", {**route, "Content-Type": "application/json"}, HIJACK
    )
    assert hijack.status == 400, hijack
    start = raw_http(
        server.port,
        "POST",
        "/files/../process.Process/Start",
        {**route, **CONNECT_JSON},
        _start_command("id -u; cat /etc/shadow"),
    )
    assert start.status == 400, start
    assert b"root:" not in start.body
    # The sandbox is as it was: its default user is still `user`, and its token still
    # guards envd.
    assert run_command(server.url, sandbox_id, "id -un", token=token).stdout == "user\n"
    unauthenticated = raw_http(
        server.port,
        "POST",
        "/process.Process/Start",
        {**route, **CONNECT_JSON},
        _start_command("id -u"),
    )
    assert unauthenticated.status == 401, unauthenticated


@pytest.mark.parametrize(
    "target",
    [
        "/files/../init",
        "/health/../init",
        "/files/./../init",
        "/files/%2e%2e/init",
        "/files/%2E%2E/process.Process/Start",
        "/files/..%2Finit",
        "/files%2F..%2Finit",
        "/files%2f..%2fprocess.Process/Start",
        "/files/..%5Cinit",
        "/files\\..\\init",
        "//init",
        "/./init",
        "/files//../init",
        "/files%00/../init",
        "http://127.0.0.1/init",
        "*",
    ],
)
def test_ambiguous_envd_paths_are_refused(
    server: ServerProcess, secured: dict[str, Any], target: str
) -> None:
    """Dot segments, empty segments, encoded separators and non-origin forms are refused
    before any access decision: 400, and the guest never sees the request."""
    response = raw_http(
        server.port,
        "POST",
        target,
        {"E2b-Sandbox-Id": secured["sandboxID"], "Content-Type": "application/json"},
        HIJACK,
    )
    assert response.status == 400, (target, response)
    assert run_command(server.url, secured["sandboxID"], "id -un").stdout == "user\n"


@pytest.mark.parametrize("target", ["/init", "/init/", "/%69nit", "/in%69t"])
def test_init_is_never_forwarded(
    server: ServerProcess, secured: dict[str, Any], target: str
) -> None:
    """/init in any spelling that decodes to it, with the sandbox's own token even."""
    response = raw_http(
        server.port,
        "POST",
        target,
        {
            "E2b-Sandbox-Id": secured["sandboxID"],
            "X-Access-Token": secured["envdAccessToken"],
            "Content-Type": "application/json",
        },
        HIJACK,
    )
    # The proxy refuses what decodes to /init; envd's public port has no /init/ either.
    assert response.status == (404 if target.endswith("/") else 403), (target, response)


def test_only_exact_public_routes_skip_the_token(
    server: ServerProcess, secured: dict[str, Any]
) -> None:
    """/health and /files are public (envd checks /files' signature itself); anything
    that merely starts with them, such as the filesystem RPCs, needs the token."""
    route = {"E2b-Sandbox-Id": secured["sandboxID"]}
    # A directory the sandbox's default user (``user``) may list: envd lists as that user.
    list_dir = json.dumps({"path": "/home/user", "depth": 1}).encode()
    json_rpc = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    for target in ("/filesystem.Filesystem/ListDir", "/filesystem.Filesystem/Stat"):
        refused = raw_http(server.port, "POST", target, {**route, **json_rpc}, list_dir)
        assert refused.status == 401, (target, refused)
    allowed = raw_http(
        server.port,
        "POST",
        "/filesystem.Filesystem/ListDir",
        {**route, **json_rpc, "X-Access-Token": secured["envdAccessToken"]},
        list_dir,
    )
    assert allowed.status == 200, allowed
    assert raw_http(server.port, "GET", "/health", route).status == 204
    # /files without token or signature: forwarded, and envd refuses it.
    shadow = raw_http(server.port, "GET", "/files?path=/etc/shadow&username=root", route)
    assert shadow.status == 401, shadow
    assert b"root:" not in shadow.body
    assert raw_http(server.port, "GET", "/filesx?path=/etc/shadow", route).status == 401
    assert raw_http(server.port, "GET", "/health/x", route).status == 401


def _post_hijack(server: ServerProcess, target: str, headers: dict[str, str]) -> int:
    """The status of the reported /init body posted to ``target``, byte for byte."""
    json_body = {"Content-Type": "application/json"}
    return raw_http(server.port, "POST", target, {**headers, **json_body}, HIJACK).status


def test_envds_control_port_is_unreachable(server: ServerProcess, secured: dict[str, Any]) -> None:
    sandbox_id, token = secured["sandboxID"], secured["envdAccessToken"]
    routed = {"E2b-Sandbox-Id": sandbox_id, "X-Access-Token": token}
    assert _post_hijack(server, "/init", {**routed, "E2b-Sandbox-Port": "49984"}) == 403
    assert _post_hijack(server, "/init", {"Host": f"49984-{sandbox_id}.sandbox.test"}) == 403
    # Host routing to envd's public port gets the same path checks as header routing.
    by_host = {"Host": f"49983-{sandbox_id}.sandbox.test"}
    assert _post_hijack(server, "/files/../init", by_host) == 400
    assert run_command(server.url, sandbox_id, "id -un", token=token).stdout == "user\n"


def test_v1_creates_are_secured(server: ServerProcess) -> None:
    """``POST /sandboxes`` secures a sandbox whatever its body says: anyone who knew the
    id could otherwise read /etc/shadow through /files."""
    with server.client() as c:
        for body in ({}, {"secure": False}, {"secure": True}):
            created = c.post("/sandboxes", json={"templateID": "base", **body})
            assert created.status_code == 201, created.text
            sandbox = created.json()
            try:
                assert sandbox.get("envdAccessToken"), body
                route = {"E2b-Sandbox-Id": sandbox["sandboxID"]}
                shadow = raw_http(
                    server.port, "GET", "/files?path=/etc/shadow&username=root", route
                )
                assert shadow.status == 401, (body, shadow)
            finally:
                c.delete(f"/sandboxes/{sandbox['sandboxID']}")


@pytest.fixture(scope="module")
def v1_flag_server(test_root: Path, guest_image: None) -> Iterator[ServerProcess]:
    node = ServerProcess(
        home=test_root / "v1-flag", extra_env={"AENV_HONOUR_V1_SECURE_FLAG": "true"}
    )
    with live_server(node) as srv:
        yield srv


def test_e2b_v1_behaviour_only_when_configured(v1_flag_server: ServerProcess) -> None:
    """With ``AENV_HONOUR_V1_SECURE_FLAG`` a v1 create is secured only on request, as in
    E2B; v2 creates stay secured."""
    srv = v1_flag_server
    with srv.client() as c:
        open_one = c.post("/sandboxes", json={"templateID": "base"}).json()
        asked = c.post("/sandboxes", json={"templateID": "base", "secure": True}).json()
        v2 = c.post("/v2/sandboxes", json={"templateID": "base"}).json()
        try:
            assert "envdAccessToken" not in open_one or not open_one["envdAccessToken"]
            assert asked.get("envdAccessToken") and v2.get("envdAccessToken")
            hostname = httpx.get(
                f"{srv.url}/files",
                params={"path": "/etc/hostname"},
                headers={"E2b-Sandbox-Id": open_one["sandboxID"]},
                trust_env=False,
            )
            assert hostname.status_code == 200, hostname.text
            for secured in (asked, v2):
                refused = httpx.get(
                    f"{srv.url}/files",
                    params={"path": "/etc/hostname"},
                    headers={"E2b-Sandbox-Id": secured["sandboxID"]},
                    trust_env=False,
                )
                assert refused.status_code == 401, refused.text
        finally:
            for sandbox in (open_one, asked, v2):
                c.delete(f"/sandboxes/{sandbox['sandboxID']}")


ECHO_PATH_SERVER = """
import http.server
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = self.path.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", 8090), Echo).serve_forever()
"""


def _serve_in_guest(server: ServerProcess, sandbox_id: str, script: str, port: int) -> None:
    """Start the Python ``script`` (a server on ``port``) in the sandbox, in the
    background, and wait until it listens."""
    quoted = script.replace("'", "'\\''")
    started = run_command(
        server.url,
        sandbox_id,
        f"printf '%s' '{quoted}' > /tmp/app-{port}.py"
        f" && (nohup python3 /tmp/app-{port}.py >/dev/null 2>&1 &)"
        f" && for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && exit 0;"
        " sleep 0.1; done; exit 1",
    )
    assert started.exit_code == 0, started.stderr


def test_other_ports_get_the_path_as_sent(server: ServerProcess, secured: dict[str, Any]) -> None:
    """An application's own paths are not envd's business: ``//`` and ``%2F`` reach it as
    the client wrote them; a dot segment, which the proxy's HTTP client would resolve, is
    refused rather than silently changed."""
    sandbox_id = secured["sandboxID"]
    _serve_in_guest(server, sandbox_id, ECHO_PATH_SERVER, 8090)
    route = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "8090"}
    for target in ("/a%2Fb//c?x=%2F..%2F", "/plain", "/caf%C3%A9"):
        echoed = raw_http(server.port, "GET", target, route)
        assert (echoed.status, echoed.body.decode()) == (200, target)
    assert raw_http(server.port, "GET", "/a/../b", route).status == 400


COOKIE_SERVER = """
import http.server
class Cookies(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (self.headers.get("Cookie") or "").encode()
        self.send_response(200)
        if self.path == "/login":
            self.send_header("Set-Cookie", "session=alice-secret; Path=/")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", 8091), Cookies).serve_forever()
"""


def test_one_clients_cookies_never_reach_anothers_requests(
    server: ServerProcess, secured: dict[str, Any]
) -> None:
    """A web app in the sandbox sets a session cookie for the client that logged in; the
    proxy must relay it to that client and keep none of it: another client's requests to
    the same app reach it with only the cookies that client sent."""
    sandbox_id = secured["sandboxID"]
    _serve_in_guest(server, sandbox_id, COOKIE_SERVER, 8091)
    route = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "8091"}
    login = raw_http(server.port, "GET", "/login", route)
    assert login.status == 200, login
    assert "session=alice-secret" in login.headers.get("set-cookie", "")
    other = raw_http(server.port, "GET", "/whoami", route)
    assert (other.status, other.body) == (200, b"")
    own = raw_http(server.port, "GET", "/whoami", {**route, "Cookie": "session=bob"})
    assert (own.status, own.body) == (200, b"session=bob")
