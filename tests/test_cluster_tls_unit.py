"""TLS in the cluster without VMs: a gateway serving HTTPS to clients reaches a node that
serves HTTPS (real uvicorn servers, certificates of a throw-away CA), verifying it with its
CA bundle, for plain requests, streamed bodies and WebSockets; a node it cannot verify is
a 503 "node unavailable"; nodes and gateways verify an HTTPS scheduler the same way."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from websockets.sync.client import connect

from agentenv.cluster.gateway import Gateway
from agentenv.cluster.gateway_server import server_tls
from agentenv.cluster.local_ca import LocalCA, make_local_ca
from agentenv.cluster.scheduler import create_scheduler_app
from agentenv.cluster.scheduler_client import SchedulerClient, SchedulerUnavailable
from agentenv.cluster.tls import TlsSetupError, check_server_files, client_context
from tests.cluster_support import KEY, Clock, ServedApp, ServedGateway, registry, report

DOMAIN = "gw.test"


@pytest.fixture
def ca(tmp_path: Path) -> LocalCA:
    return make_local_ca(tmp_path / "ca", DOMAIN)


def tls_node() -> Starlette:
    """A node's proxy as the gateway sees it: it says how it was reached, sends a body
    back streamed, and echoes WebSocket messages."""

    async def seen(request: Request) -> Response:
        if request.method == "POST":
            body = await request.body()

            async def back() -> AsyncIterator[bytes]:
                for start in range(0, len(body), 65536):
                    yield body[start : start + 65536]

            return StreamingResponse(back())
        host, sandbox = request.headers.get("host"), request.headers.get("e2b-sandbox-id")
        return PlainTextResponse(f"{request.url.scheme} {host} {sandbox}")

    async def echo(ws: WebSocket) -> None:
        await ws.accept()
        await ws.send_text(f"{ws.url.scheme} {ws.headers.get('host')}")
        async for text in ws.iter_text():
            await ws.send_text(text.upper())

    return Starlette(
        routes=[
            WebSocketRoute("/ws", echo),
            Route("/{path:path}", seen, methods=["GET", "POST"]),
        ]
    )


def gateway_to(node_url: str, ca_file: Path | None) -> Gateway:
    """A gateway whose scheduler knows one node, ``a`` at ``node_url``, holding ``itls``."""
    reg = registry(Clock())
    scheduler_app = create_scheduler_app(reg, KEY)
    scheduler = SchedulerClient(
        "http://scheduler.test", KEY, transport=httpx.ASGITransport(app=scheduler_app)
    )

    async def register() -> None:
        await reg.heartbeat(report("a", url=node_url))
        await reg.bind("itls", "a")

    asyncio.run(register())
    return Gateway(scheduler, KEY, DOMAIN, ca_file=ca_file)


def test_a_tls_gateway_relays_to_tls_nodes_verified_by_its_ca(ca: LocalCA) -> None:
    trust = client_context(ca.ca_cert)
    with ServedApp(tls_node(), ca.server_cert, ca.server_key) as node:
        gateway = gateway_to(node.url, ca.ca_cert)
        tls = server_tls(str(ca.server_cert), str(ca.server_key))
        with ServedGateway(gateway, tls) as served:
            assert served.url.startswith("https://")
            with httpx.Client(base_url=served.url, verify=trust, trust_env=False) as client:
                by_header = client.get("/files", headers={"E2b-Sandbox-Id": "itls"})
                assert by_header.text == f"https 127.0.0.1:{served.port} itls"
                by_host = client.get("/", headers={"Host": f"8080-itls.{DOMAIN}"})
                assert by_host.text == f"https 8080-itls.{DOMAIN} None"
                payload = bytes(range(256)) * 4096
                streamed = client.post(
                    "/upload", headers={"E2b-Sandbox-Id": "itls"}, content=iter([payload] * 4)
                )
                assert streamed.status_code == 200 and streamed.content == payload * 4
            # WebSockets over TLS both ways: the node sees the client's Host.
            url = f"wss://127.0.0.1:{served.port}/ws"
            headers = {"E2b-Sandbox-Id": "itls"}
            with connect(url, ssl=trust, additional_headers=headers) as ws:
                assert ws.recv(timeout=30) == f"wss 127.0.0.1:{served.port}"
                ws.send("over tls")
                assert ws.recv(timeout=30) == "OVER TLS"


def test_a_node_the_gateway_cannot_verify_is_unavailable(ca: LocalCA) -> None:
    with ServedApp(tls_node(), ca.server_cert, ca.server_key) as node:
        # No CA bundle: the system's trusted certificates, which do not include this CA.
        gateway = gateway_to(node.url, None)
        with ServedGateway(gateway) as served, httpx.Client(base_url=served.url) as client:
            answer = client.get("/files", headers={"E2b-Sandbox-Id": "itls"})
            assert answer.status_code == 503
            message = answer.json()["message"]
            assert "node unavailable" in message and "CERTIFICATE_VERIFY_FAILED" in message
            refused = httpx.get(
                f"{served.url}/ws",
                headers={
                    "E2b-Sandbox-Id": "itls",
                    "Connection": "Upgrade",
                    "Upgrade": "websocket",
                    "Sec-WebSocket-Version": "13",
                    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                },
            )
            assert refused.status_code == 503 and b"node unavailable" in refused.content


async def test_nodes_and_gateways_verify_an_https_scheduler(ca: LocalCA) -> None:
    reg = registry(Clock())
    with ServedApp(create_scheduler_app(reg, KEY), ca.server_cert, ca.server_key) as served:
        trusting = SchedulerClient(served.url, KEY, ca_file=ca.ca_cert)
        assert (await trusting.heartbeat(report("a"))).node_id == "a"
        assert [n.node_id for n in await trusting.nodes()] == ["a"]
        await trusting.aclose()
        untrusting = SchedulerClient(served.url, KEY)
        with pytest.raises(SchedulerUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusting.nodes()
        await untrusting.aclose()


def test_unusable_tls_files_are_clear_errors(ca: LocalCA, tmp_path: Path) -> None:
    check_server_files(ca.server_cert, ca.server_key)
    with pytest.raises(TlsSetupError, match="cannot serve TLS"):
        check_server_files(ca.server_cert, ca.ca_cert)
    with pytest.raises(TlsSetupError, match="CA bundle"):
        client_context(tmp_path / "missing.pem")
    assert isinstance(client_context(ca.ca_cert), ssl.SSLContext)
