"""The node's envd client against stand-in guests on loopback (no VMs): /init goes to
envd's control port, and to the public port only for an envd saved before the control
port existed."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from agentenv.network.addresses import ENVD_CONTROL_PORT, ENVD_PORT
from agentenv.orchestrator import envd_client

# A loopback address of its own, so the fixed envd ports are free whatever else runs.
GUEST = "127.83.0.9"


class StandInEnvd(asyncio.Protocol):
    """Answers every request 204, ``delay`` seconds after it came, and records (port,
    request line, body)."""

    def __init__(
        self, port: int, seen: list[tuple[int, str, dict[str, object]]], delay: float = 0.0
    ) -> None:
        self.port, self.seen, self.buffer, self.delay = port, seen, b"", delay

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head, sep, body = self.buffer.partition(b"\r\n\r\n")
        if not sep:
            return
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(body) < length:
            return
        self.seen.append((self.port, head.split(b"\r\n")[0].decode(), json.loads(body or b"{}")))
        asyncio.get_running_loop().call_later(self.delay, self._answer)

    def _answer(self) -> None:
        if self.transport.is_closing():
            return  # the client gave up on this request
        self.transport.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
        self.transport.close()


@contextlib.asynccontextmanager
async def guest(
    *ports: int, delay: float = 0.0
) -> AsyncIterator[list[tuple[int, str, dict[str, object]]]]:
    seen: list[tuple[int, str, dict[str, object]]] = []
    loop = asyncio.get_running_loop()
    servers = [
        await loop.create_server(functools.partial(StandInEnvd, port, seen, delay), GUEST, port)
        for port in ports
    ]
    try:
        yield seen
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()


async def test_init_goes_to_the_control_port() -> None:
    async with guest(ENVD_PORT, ENVD_CONTROL_PORT) as seen, httpx.AsyncClient() as client:
        attempts = await envd_client.init(client, GUEST, env_vars={"A": "1"}, access_token="tok")
    assert attempts == 1
    assert [(port, line) for port, line, _ in seen] == [(ENVD_CONTROL_PORT, "POST /init HTTP/1.1")]
    assert seen[0][2]["accessToken"] == "tok" and seen[0][2]["envVars"] == {"A": "1"}


async def test_an_envd_without_a_control_port_gets_its_legacy_init() -> None:
    async with guest(ENVD_PORT) as seen, httpx.AsyncClient() as client:
        attempts = await envd_client.init(client, GUEST, env_vars={}, access_token="tok")
    # The refused control port, then the public one.
    assert attempts == 2
    assert [(port, line) for port, line, _ in seen] == [(ENVD_PORT, "POST /init HTTP/1.1")]


async def test_no_envd_at_all_is_unreachable() -> None:
    async with httpx.AsyncClient() as client:
        with pytest.raises(envd_client.EnvdUnreachable):
            await envd_client.init(client, GUEST, env_vars={}, access_token=None, timeout=0.3)


async def test_a_slow_guest_is_not_sent_its_init_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest that took the /init but answers late (a fork child on a busy TCG host) is
    waited for until the /init deadline, not sent the request again once the connect
    timeout passed: each copy is work for a guest already short of CPU."""
    monkeypatch.setattr(envd_client, "INIT_CONNECT_TIMEOUT_S", 0.2)
    async with guest(ENVD_CONTROL_PORT, delay=1.0) as seen, httpx.AsyncClient() as client:
        attempts = await envd_client.init(client, GUEST, env_vars={}, access_token="t", timeout=10)
    assert attempts == 1
    assert [(port, line) for port, line, _ in seen] == [(ENVD_CONTROL_PORT, "POST /init HTTP/1.1")]
