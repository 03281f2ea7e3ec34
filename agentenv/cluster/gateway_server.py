"""The gateway served: its front (``front``) on the public address, over TLS when given a
certificate, and its ASGI app (:class:`~agentenv.cluster.gateway.Gateway`) served by
uvicorn, through uvicorn's public API, on a Unix socket in a directory made for it
(mode 0700: only this process's user can reach the app without going through the front).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import tempfile

import uvicorn

from agentenv.api.http_protocol import JsonErrorsHttpToolsProtocol
from agentenv.cluster.front import GatewayFront
from agentenv.cluster.gateway import KEEP_ALIVE_S, Gateway

#: The app's bound on a request head, as every agentenv server's (see http_protocol); the
#: front refuses heads over 16 KiB of headers before they reach it.
_APP_MAX_HEAD_BYTES = 1024 * 1024
_BACKLOG = 2048


def server_tls(cert: str, key: str) -> ssl.SSLContext:
    """What the front serves TLS with (checked beforehand by ``tls.check_server_files``)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


class GatewayServer:
    """:meth:`start`, then :meth:`wait` (until uvicorn is told to stop, e.g. by SIGTERM
    or :meth:`stop`), then :meth:`stop`."""

    def __init__(
        self,
        gateway: Gateway,
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None = None,
        keep_alive_s: float = KEEP_ALIVE_S,
    ) -> None:
        self.gateway = gateway
        self.host = host
        self.port = port
        self.tls = tls
        self.keep_alive_s = keep_alive_s
        self._dir = tempfile.mkdtemp(prefix="aenv-gateway-")
        self.app_socket = os.path.join(self._dir, "app.sock")
        self._app = uvicorn.Server(
            uvicorn.Config(
                gateway,
                uds=self.app_socket,
                log_level="warning",
                timeout_keep_alive=int(keep_alive_s),
                h11_max_incomplete_event_size=_APP_MAX_HEAD_BYTES,
                http=JsonErrorsHttpToolsProtocol,
                # Relayed answers carry the node's Server header: the app's answers
                # carry none either. (Its Date header stays.)
                server_header=False,
            )
        )
        self._app_task: asyncio.Task[None] | None = None
        self._listener: asyncio.Server | None = None
        self.front: GatewayFront | None = None

    async def start(self) -> None:
        self._app_task = asyncio.create_task(self._app.serve())
        while not self._app.started:
            if self._app_task.done():
                self._app_task.result()  # its error, if it failed to start
                raise RuntimeError("the gateway's app stopped as it started")
            await asyncio.sleep(0.01)
        self.front = GatewayFront(self.gateway, self.app_socket, keep_alive_s=self.keep_alive_s)
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            self.front, self.host, self.port, ssl=self.tls, backlog=_BACKLOG, reuse_address=True
        )

    async def wait(self) -> None:
        if self._app_task is not None:
            await self._app_task

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self.front is not None:
            self.front.close()
        self._app.should_exit = True
        if self._app_task is not None:
            await self._app_task
        if self._listener is not None:
            await self._listener.wait_closed()
        shutil.rmtree(self._dir, ignore_errors=True)


async def serve(server: GatewayServer) -> None:
    """Serve until uvicorn sees SIGINT or SIGTERM (it stops the app, lifespan included)."""
    await server.start()
    try:
        await server.wait()
    finally:
        await server.stop()
