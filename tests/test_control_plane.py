"""Control-plane behaviour the E2B SDK relies on, over raw HTTP against real sandboxes:
secured sandboxes, idempotent creates, metrics, and WebSocket traffic through the proxy."""

from __future__ import annotations

import socket
import textwrap
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.helpers import SANDBOX_DOMAIN, ServerProcess, run_command

pytestmark = pytest.mark.vm

# A WebSocket echo server for the guest, stdlib only (the guest's own python3).
WS_ECHO_SERVER = textwrap.dedent(
    """
    import base64, hashlib, socketserver, struct

    GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

    class Echo(socketserver.StreamRequestHandler):
        def handle(self):
            headers = {}
            self.rfile.readline()
            while (line := self.rfile.readline().decode().strip()):
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
            accept = base64.b64encode(
                hashlib.sha1((headers["sec-websocket-key"] + GUID).encode()).digest()
            ).decode()
            self.wfile.write(
                b"HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\n"
                b"Connection: Upgrade\\r\\nSec-WebSocket-Accept: " + accept.encode()
                + b"\\r\\n\\r\\n"
            )
            while True:
                head = self.rfile.read(2)
                if len(head) < 2:
                    return
                opcode, length = head[0] & 0x0F, head[1] & 0x7F
                if length == 126:
                    length = struct.unpack(">H", self.rfile.read(2))[0]
                elif length == 127:
                    length = struct.unpack(">Q", self.rfile.read(8))[0]
                mask = self.rfile.read(4)
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
                if opcode == 8:
                    self.wfile.write(b"\\x88\\x00")
                    return
                if length < 126:
                    header = bytes([0x80 | opcode, length])
                else:
                    header = bytes([0x80 | opcode, 126]) + struct.pack(">H", length)
                self.wfile.write(header + data)

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    socketserver.ThreadingTCPServer(("0.0.0.0", 8765), Echo).serve_forever()
    """
)


def test_v2_sandboxes_are_secured(server: ServerProcess) -> None:
    with server.client() as c:
        a = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()
        b = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()
        try:
            token_a, token_b = a["envdAccessToken"], b["envdAccessToken"]
            assert token_a and token_b and token_a != token_b
            assert (
                run_command(server.url, a["sandboxID"], "echo ok", token=token_a).stdout == "ok\n"
            )
            for token in (None, token_b):
                headers = {
                    "E2b-Sandbox-Id": a["sandboxID"],
                    "Content-Type": "application/connect+json",
                }
                if token:
                    headers["X-Access-Token"] = token
                refused = httpx.post(
                    f"{server.url}/process.Process/List",
                    headers=headers,
                    content=b"{}",
                    trust_env=False,
                )
                assert refused.status_code == 401, refused.text
            # /health stays public; /init is never reachable from outside.
            health = httpx.get(
                f"{server.url}/health", headers={"E2b-Sandbox-Id": a["sandboxID"]}, trust_env=False
            )
            assert health.status_code == 204
            init = httpx.post(
                f"{server.url}/init",
                json={"accessToken": ""},
                headers={"E2b-Sandbox-Id": a["sandboxID"], "X-Access-Token": token_a},
                trust_env=False,
            )
            assert init.status_code == 403
            assert c.get(f"/sandboxes/{a['sandboxID']}").json()["envdAccessToken"] == token_a
        finally:
            c.delete(f"/sandboxes/{a['sandboxID']}")
            c.delete(f"/sandboxes/{b['sandboxID']}")


def test_idempotency_key_returns_the_same_sandbox(server: ServerProcess) -> None:
    with server.client() as c:
        headers = {"Idempotency-Key": f"test-{time.monotonic_ns()}"}
        first = c.post("/v2/sandboxes", json={"templateID": "base"}, headers=headers)
        again = c.post("/v2/sandboxes", json={"templateID": "base"}, headers=headers)
        other = c.post("/v2/sandboxes", json={"templateID": "base"})
        try:
            assert first.status_code == again.status_code == other.status_code == 201
            assert first.json()["sandboxID"] == again.json()["sandboxID"]
            assert other.json()["sandboxID"] != first.json()["sandboxID"]
        finally:
            c.delete(f"/sandboxes/{first.json()['sandboxID']}")
            c.delete(f"/sandboxes/{other.json()['sandboxID']}")


def test_metrics_come_from_the_guest(server: ServerProcess) -> None:
    with server.client() as c:
        sbx = c.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()
        try:
            response = c.get(f"/sandboxes/{sbx['sandboxID']}/metrics")
            assert response.status_code == 200, response.text
            (metric,) = response.json()
            assert metric["cpuCount"] >= 1
            assert 0 < metric["memUsed"] < metric["memTotal"]
            assert 0 < metric["diskUsed"] < metric["diskTotal"]
            assert abs(metric["timestampUnix"] - time.time()) < 60
            assert c.get("/sandboxes/inope/metrics").status_code == 404
        finally:
            c.delete(f"/sandboxes/{sbx['sandboxID']}")


def test_websocket_through_the_proxy(server: ServerProcess) -> None:
    with server.client() as c:
        sbx = c.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()
        sandbox_id = sbx["sandboxID"]
        try:
            script = WS_ECHO_SERVER.replace("'", "'\\''")
            started = run_command(
                server.url,
                sandbox_id,
                f"printf '%s' '{script}' > /tmp/ws.py && "
                "(nohup python3 /tmp/ws.py >/tmp/ws.log 2>&1 &) && "
                "for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/8765) 2>/dev/null "
                "&& exit 0; sleep 0.1; done; cat /tmp/ws.log; exit 1",
            )
            assert started.exit_code == 0, started.stdout + started.stderr
            url = f"ws://127.0.0.1:{server.port}/echo"
            headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "8765"}
            with ws_connect(url, additional_headers=headers, open_timeout=30) as ws:
                ws.send("hello sandbox")
                assert ws.recv(timeout=30) == "hello sandbox"
                payload = bytes(range(256)) * 4
                ws.send(payload)
                assert ws.recv(timeout=30) == payload
            # Host-based routing reaches the same port: the URL names the sandbox, the
            # socket goes to the server.
            sock = socket.create_connection(("127.0.0.1", server.port))
            host_url = f"ws://8765-{sandbox_id}.{SANDBOX_DOMAIN}:{server.port}/echo"
            with ws_connect(host_url, sock=sock, open_timeout=30) as ws:
                ws.send("via host")
                assert ws.recv(timeout=30) == "via host"
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")


def test_kill_closes_a_proxied_websocket(server: ServerProcess) -> None:
    """A killed guest never closes its connections: the proxy closes the client's
    WebSocket itself (1001, going away) when the kill begins."""
    with server.client() as c:
        sandbox_id = c.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()[
            "sandboxID"
        ]
        try:
            script = WS_ECHO_SERVER.replace("'", "'\\''")
            started = run_command(
                server.url,
                sandbox_id,
                f"printf '%s' '{script}' > /tmp/ws.py && "
                "(nohup python3 /tmp/ws.py >/tmp/ws.log 2>&1 &) && "
                "for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/8765) 2>/dev/null "
                "&& exit 0; sleep 0.1; done; cat /tmp/ws.log; exit 1",
            )
            assert started.exit_code == 0, started.stdout + started.stderr
            url = f"ws://127.0.0.1:{server.port}/echo"
            headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "8765"}
            with ws_connect(url, additional_headers=headers, open_timeout=30) as ws:
                ws.send("before")
                assert ws.recv(timeout=30) == "before"
                assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
                killed = time.monotonic()
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=30)
                assert time.monotonic() - killed < 15
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
                assert "was not found" in closed.value.rcvd.reason
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")
