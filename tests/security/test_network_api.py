"""E2B's network options against real VMs, through the real server and proxy, with raw
sockets (every request written byte for byte, Host included).

What these reproduce: ``network.allowPublicTraffic: false`` was accepted and ignored (no
``trafficAccessToken``, port 8080 open to anyone); ``Host: 8080-<id>.anything`` reached
the sandbox whatever the configured domain; the other network options were ignored
silently. A guest HTTP server on port 8080 answers with the Host header it was sent, so
``maskRequestHost`` is checked where it matters, in the guest.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from e2b import Sandbox, SandboxException
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from tests.e2b.support import sdk_opts
from tests.helpers import SANDBOX_DOMAIN, ServerProcess, raw_http, run_command

pytestmark = pytest.mark.vm

GUEST_PORT = 8080
WS_PORT = 8765
MASK = "${PORT}-masked.example.com"
# Answers every GET with "host=<the Host header it got>".
HOST_ECHO = (
    "import http.server\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = ('host=' + str(self.headers.get('Host'))).encode()\n"
    "        self.send_response(200)\n"
    "        self.send_header('Content-Length', str(len(body)))\n"
    "        self.end_headers()\n"
    "        self.wfile.write(body)\n"
    f"http.server.ThreadingHTTPServer(('0.0.0.0', {GUEST_PORT}), H).serve_forever()\n"
)


# A WebSocket server that accepts, sends one text message "host=<the Host header>", and
# closes.
WS_HOST_ECHO = (
    "import base64, hashlib, socketserver\n"
    "GUID = '258EAFA5-E914-47DA-95CA-C5AB0DC85B11'\n"
    "class H(socketserver.StreamRequestHandler):\n"
    "    def handle(self):\n"
    "        headers = {}\n"
    "        self.rfile.readline()\n"
    "        while (line := self.rfile.readline().decode().strip()):\n"
    "            k, v = line.split(':', 1)\n"
    "            headers[k.strip().lower()] = v.strip()\n"
    "        key = headers['sec-websocket-key'] + GUID\n"
    "        accept = base64.b64encode(hashlib.sha1(key.encode()).digest())\n"
    "        self.wfile.write(b'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\n'\n"
    "            b'Connection: Upgrade\\r\\nSec-WebSocket-Accept: ' + accept + b'\\r\\n\\r\\n')\n"
    "        text = ('host=' + headers.get('host', '')).encode()[:125]\n"
    "        self.wfile.write(bytes([0x81, len(text)]) + text + b'\\x88\\x00')\n"
    "socketserver.ThreadingTCPServer.allow_reuse_address = True\n"
    f"socketserver.ThreadingTCPServer(('0.0.0.0', {WS_PORT}), H).serve_forever()\n"
)


def _start_host_echo(server: ServerProcess, sandbox: dict[str, Any]) -> None:
    """Both echo servers, listening."""
    commands = []
    for name, script, port in (("echo", HOST_ECHO, GUEST_PORT), ("ws", WS_HOST_ECHO, WS_PORT)):
        quoted = script.replace("'", "'\\''")
        commands.append(
            f"printf '%s' '{quoted}' > /tmp/{name}.py && "
            f"(nohup python3 /tmp/{name}.py >/tmp/{name}.log 2>&1 &) && "
            f"for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null "
            f"&& break; sleep 0.1; done && (exec 3<>/dev/tcp/127.0.0.1/{port}) "
            f"|| {{ cat /tmp/{name}.log; exit 1; }}"
        )
    started = run_command(
        server.url,
        sandbox["sandboxID"],
        " && ".join(commands),
        token=sandbox.get("envdAccessToken"),
    )
    assert started.exit_code == 0, started.stdout + started.stderr


def _get(server: ServerProcess, headers: dict[str, str]) -> tuple[int, bytes]:
    response = raw_http(server.port, "GET", "/", headers)
    return response.status, response.body


def _routed(sandbox_id: str, **extra: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(GUEST_PORT), **extra}


def _create(server: ServerProcess, **body: Any) -> dict[str, Any]:
    with server.client() as c:
        created = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600, **body})
    assert created.status_code == 201, created.text
    result: dict[str, Any] = created.json()
    return result


@pytest.fixture(scope="module")
def private(server: ServerProcess) -> Iterator[dict[str, Any]]:
    """A sandbox refusing public traffic, with a Host mask, running the Host echo."""
    sandbox = _create(server, network={"allowPublicTraffic": False, "maskRequestHost": MASK})
    try:
        _start_host_echo(server, sandbox)
        yield sandbox
    finally:
        with server.client() as c:
            c.delete(f"/sandboxes/{sandbox['sandboxID']}")


def test_private_ports_need_the_traffic_token(
    server: ServerProcess, private: dict[str, Any]
) -> None:
    sandbox_id, token = private["sandboxID"], private["trafficAccessToken"]
    assert token and token != private["envdAccessToken"]
    refused = [
        _routed(sandbox_id),
        _routed(sandbox_id, **{"E2b-Traffic-Access-Token": ""}),
        _routed(sandbox_id, **{"E2b-Traffic-Access-Token": token[:-1]}),
        _routed(sandbox_id, **{"E2b-Traffic-Access-Token": private["envdAccessToken"]}),
        _routed(sandbox_id, **{"X-Access-Token": private["envdAccessToken"]}),
        {"Host": f"{GUEST_PORT}-{sandbox_id}.{SANDBOX_DOMAIN}"},
    ]
    for headers in refused:
        status, body = _get(server, headers)
        assert status == 403, (headers, status, body)
        assert b"host=" not in body
    status, body = _get(server, _routed(sandbox_id, **{"E2b-Traffic-Access-Token": token}))
    assert status == 200, body
    # The guest saw the mask, with the port filled in, not the proxy's or client's Host.
    assert body == f"host={GUEST_PORT}-masked.example.com".encode()
    by_host = {
        "Host": f"{GUEST_PORT}-{sandbox_id}.{SANDBOX_DOMAIN.upper()}:{server.port}",
        "e2b-traffic-access-token": token,
    }
    assert _get(server, by_host) == (200, f"host={GUEST_PORT}-masked.example.com".encode())
    # envd's port keeps its own rule: its token, not the traffic token.
    envd = raw_http(server.port, "GET", "/health", {"E2b-Sandbox-Id": sandbox_id})
    assert envd.status in (200, 204), envd


def test_private_websockets_need_the_traffic_token(
    server: ServerProcess, private: dict[str, Any]
) -> None:
    """The WebSocket path applies the same token rule and the same Host mask."""
    sandbox_id, token = private["sandboxID"], private["trafficAccessToken"]
    url = f"ws://127.0.0.1:{server.port}/"
    routed = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(WS_PORT)}
    with pytest.raises(InvalidStatus) as refused:
        ws_connect(url, additional_headers=routed, open_timeout=30)
    assert refused.value.response.status_code == 403
    wrong = {**routed, "E2b-Traffic-Access-Token": "x" + token}
    with pytest.raises(InvalidStatus) as refused:
        ws_connect(url, additional_headers=wrong, open_timeout=30)
    assert refused.value.response.status_code == 403
    allowed = {**routed, "E2b-Traffic-Access-Token": token}
    with ws_connect(url, additional_headers=allowed, open_timeout=30) as ws:
        assert ws.recv(timeout=30) == f"host={WS_PORT}-masked.example.com"


def test_host_routing_only_under_the_configured_domain(
    server: ServerProcess, private: dict[str, Any]
) -> None:
    sandbox_id, token = private["sandboxID"], private["trafficAccessToken"]
    for host in (
        f"{GUEST_PORT}-{sandbox_id}.anything",
        f"{GUEST_PORT}-{sandbox_id}.{SANDBOX_DOMAIN}.evil.example",
        f"{GUEST_PORT}-{sandbox_id}.x{SANDBOX_DOMAIN}",
    ):
        status, body = _get(server, {"Host": host, "e2b-traffic-access-token": token})
        # Not sandbox traffic: the control plane answers, and knows no such route.
        assert status == 404, (host, status, body)
        assert b"host=" not in body


def test_public_ports_stay_open_without_a_token(server: ServerProcess) -> None:
    """The default (allowPublicTraffic omitted): E2B's ports are public."""
    sandbox = _create(server)
    try:
        assert sandbox["trafficAccessToken"] is None
        _start_host_echo(server, sandbox)
        host = f"{GUEST_PORT}-{sandbox['sandboxID']}.{SANDBOX_DOMAIN}"
        status, body = _get(server, {"Host": host})
        # Without a mask the guest sees the Host the proxy's client sends, as before.
        assert status == 200 and body.startswith(b"host=") and b"masked" not in body, body
    finally:
        with server.client() as c:
            c.delete(f"/sandboxes/{sandbox['sandboxID']}")


def test_unsupported_options_are_refused_by_name(server: ServerProcess) -> None:
    with server.client() as c:
        before = len(c.get("/v2/sandboxes").json())
        for network, named in [
            ({"egressProxy": {"address": "proxy.example.com:1080"}}, "egressProxy"),
            (
                {
                    "allowOut": ["api.example.com"],
                    "rules": {
                        "api.example.com": [
                            {"transform": {"headers": {"a": "${e2b.identity.tokens.aws}"}}}
                        ]
                    },
                },
                "workload identity",
            ),
            ({"httpsPorts": [3000]}, "httpsPorts"),
            ({"allowOut": ["fe80::/10"]}, "allowOut"),
        ]:
            refused = c.post("/v2/sandboxes", json={"templateID": "base", "network": network})
            assert refused.status_code == 400, refused.text
            assert named in refused.json()["message"]
        assert len(c.get("/v2/sandboxes").json()) == before
    # The unmodified SDK gets the same answer, as an exception naming the option.
    with pytest.raises(SandboxException, match="httpsPorts"):
        Sandbox.create("base", network={"https_ports": [3000]}, **sdk_opts(server))


def test_update_network_through_the_sdk(server: ServerProcess) -> None:
    sandbox = _create(server, network={"denyOut": ["0.0.0.0/0"]})
    sandbox_id = sandbox["sandboxID"]
    try:
        update = {"allow_out": ["1.1.1.1"], "deny_out": ["0.0.0.0/0"], "dns_servers": ["1.1.1.1"]}
        try:
            Sandbox.update_network(sandbox_id, update, **sdk_opts(server))  # type: ignore[call-overload]
        except SandboxException as exc:
            # Until the host's egress filter can change a running sandbox's rules, the
            # server says so; the old rules stay in force and on record.
            assert "not implemented" in str(exc), exc
            wanted_out: list[str] = []
        else:
            wanted_out = ["1.1.1.1/32"]
        with server.client() as c:
            detail = c.get(f"/sandboxes/{sandbox_id}").json()
        assert detail["network"]["allowOut"] == wanted_out
        assert detail["network"]["denyOut"] == ["0.0.0.0/0"]
        with pytest.raises(SandboxException, match="egressProxy"):
            Sandbox.update_network(
                sandbox_id,
                {"egress_proxy": {"address": "proxy.example.com:1080"}},
                **sdk_opts(server),
            )
    finally:
        with server.client() as c:
            c.delete(f"/sandboxes/{sandbox_id}")


def _wait_for_echo(server: ServerProcess, headers: dict[str, str]) -> tuple[int, bytes]:
    deadline = time.monotonic() + 30
    status, body = _get(server, headers)
    while status == 502 and time.monotonic() < deadline:
        time.sleep(0.3)
        status, body = _get(server, headers)
    return status, body


def test_pause_resume_and_fork_keep_the_options(server: ServerProcess) -> None:
    network = {"allowPublicTraffic": False, "maskRequestHost": MASK, "denyOut": ["10.0.0.0/8"]}
    sandbox = _create(server, network=network, allow_internet_access=False)
    sandbox_id, token = sandbox["sandboxID"], sandbox["trafficAccessToken"]
    children: list[str] = []
    try:
        _start_host_echo(server, sandbox)
        with server.client() as c:
            shown = c.get(f"/sandboxes/{sandbox_id}").json()
            assert shown["allowInternetAccess"] is False
            assert (c.post(f"/sandboxes/{sandbox_id}/pause", json={})).status_code == 204
            time.sleep(1.5)  # past the test server's network linger: rebuilt on resume
            resumed = c.post(f"/v2/sandboxes/{sandbox_id}/connect", json={"timeout": 600})
            assert resumed.status_code == 201, resumed.text
            assert resumed.json()["trafficAccessToken"] == token
            after = c.get(f"/sandboxes/{sandbox_id}").json()
            assert (after["network"], after["allowInternetAccess"]) == (shown["network"], False)
        masked = f"host={GUEST_PORT}-masked.example.com".encode()
        assert _wait_for_echo(server, _routed(sandbox_id))[0] == 403
        with_token = _routed(sandbox_id, **{"E2b-Traffic-Access-Token": token})
        assert _wait_for_echo(server, with_token) == (200, masked)

        with server.client() as c:
            forked = c.post(f"/sandboxes/{sandbox_id}/fork", json={"count": 1, "timeout": 600})
            assert forked.status_code == 201, forked.text
            child = forked.json()[0]["sandbox"]
            children.append(child["sandboxID"])
            child_detail = c.get(f"/sandboxes/{child['sandboxID']}").json()
        assert (child_detail["network"], child_detail["allowInternetAccess"]) == (
            shown["network"],
            False,
        )
        child_token = child["trafficAccessToken"]
        assert child_token and child_token != token
        # The child's copy of the echo server is behind the child's token only.
        parent_token = _routed(child["sandboxID"], **{"E2b-Traffic-Access-Token": token})
        assert _wait_for_echo(server, parent_token)[0] == 403
        own = _routed(child["sandboxID"], **{"E2b-Traffic-Access-Token": child_token})
        assert _wait_for_echo(server, own) == (200, masked)
    finally:
        with server.client() as c:
            for doomed in [*children, sandbox_id]:
                c.delete(f"/sandboxes/{doomed}")


def test_detail_shows_the_options_as_e2b_does(server: ServerProcess) -> None:
    """``Sandbox.get_info`` parses ``network`` and ``allowInternetAccess``."""
    sandbox = _create(server, network={"allowOut": ["example.com"], "denyOut": ["0.0.0.0/0"]})
    try:
        info = Sandbox.get_info(sandbox["sandboxID"], **sdk_opts(server))
        assert info.allow_internet_access is True
        network = info.network
        assert network is not None, info
        assert network["allow_out"] == ["example.com"]
        assert network["deny_out"] == ["0.0.0.0/0"]
        assert network["allow_public_traffic"] is True
    finally:
        with server.client() as c:
            c.delete(f"/sandboxes/{sandbox['sandboxID']}")
