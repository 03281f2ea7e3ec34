"""What the cluster's unit tests share: node reports, a settable clock, a registry over a
store, a real redis-server, ASGI apps served by uvicorn on a free port (over TLS when
given a certificate), gateways served as ``aenv-gateway`` serves them; and the VM tests'
local cluster (:func:`running_cluster`)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import uvloop
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from agentenv.cluster.gateway import Gateway
from agentenv.cluster.gateway_server import GatewayServer
from agentenv.cluster.local import LocalCluster
from agentenv.cluster.models import NodeReport
from agentenv.cluster.placement import LeastLoaded
from agentenv.cluster.registry import NodeRegistry
from agentenv.cluster.store import MemoryStore
from tests.helpers import cleanup_host, free_port

KEY = "e2b_" + "cd" * 20


def report(node_id: str, **fields: Any) -> NodeReport:
    values: dict[str, Any] = {
        "nodeID": node_id,
        "url": f"http://{node_id}.test",
        "cpuCount": 4,
        "memoryMib": 4096,
        "allocatedVcpus": 0,
        "allocatedMemoryMib": 0,
        "sandboxVcpus": 2,
        "sandboxMemoryMib": 512,
        "templates": ["base"],
        **fields,
    }
    return NodeReport.model_validate(values)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def registry(clock: Clock, store: Any = None, overcommit: float = 1.0) -> NodeRegistry:
    return NodeRegistry(
        store or MemoryStore(),
        LeastLoaded(overcommit=overcommit),
        node_timeout=5.0,
        binding_grace=10.0,
        clock=clock,
    )


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    """A real redis-server on a free port, its URL; skips the test where none is installed."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (scripts/install installs it)")
    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                subprocess.run(
                    ["redis-cli", "-p", str(port), "ping"], check=True, capture_output=True
                )
                break
            except subprocess.CalledProcessError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


class ServedApp:
    """An ASGI app served by uvicorn on a free port, in a thread, for the block; over TLS
    with ``cert`` and ``key``."""

    def __init__(self, app: Any, cert: Path | None = None, key: Path | None = None) -> None:
        self.port = free_port()
        self.scheme = "https" if cert else "http"
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                ssl_certfile=cert,
                ssl_keyfile=key,
            )
        )

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def __enter__(self) -> ServedApp:
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class ServedGateway:
    """A gateway served as ``aenv-gateway`` serves it (its front on a free port, its app
    behind it), in a thread with its own loop, for the block."""

    def __init__(self, gateway: Gateway, tls: ssl.SSLContext | None = None) -> None:
        self.port = free_port()
        self.scheme = "https" if tls else "http"
        self.server = GatewayServer(gateway, "127.0.0.1", self.port, tls=tls)
        self.loop = uvloop.new_event_loop()  # as aenv-gateway runs it

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def __enter__(self) -> ServedGateway:
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def echo_node() -> Any:
    """A node that echoes WebSocket messages upper-cased, after a first one naming the
    Host and E2b-Sandbox-Id it was sent."""

    async def echo(ws: WebSocket) -> None:
        await ws.accept()
        seen = f"{ws.headers.get('host')} {ws.headers.get('e2b-sandbox-id')}"
        await ws.send_text(seen)
        async for text in ws.iter_text():
            await ws.send_text(text.upper())

    return Starlette(routes=[WebSocketRoute("/ws", echo)])


@contextlib.contextmanager
def running_cluster(root: Path, **options: Any) -> Iterator[LocalCluster]:
    """A :class:`LocalCluster` under ``root`` for the block (heartbeats every 0.5 s, a
    node down after 5 s, networks of paused sandboxes kept 1 s, unless ``options`` say
    otherwise); afterwards stopped and every node's host resources released."""
    options.setdefault("heartbeat_interval", 0.5)
    options.setdefault("node_timeout", 5.0)
    options.setdefault("node_env", {"AENV_NETWORK_LINGER": "1"})
    local = LocalCluster(root, **options)
    try:
        local.up()
        yield local
    finally:
        local.down()
        for index in range(local.nodes):
            cleanup_host(local.root / local.node_name(index))
