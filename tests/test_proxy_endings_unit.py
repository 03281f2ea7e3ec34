"""How the proxy ends a sandbox's open exchanges when the sandbox is killed, expires or
is paused (no VMs: the SDK's view end to end is tests/e2b/test_sdk_stream_endings.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from agentenv.orchestrator.states import SandboxState, traffic_end
from agentenv.proxy.endings import (
    ConnectFraming,
    TrafficEndings,
    end_stream_error,
    gone_message,
    is_connect_stream,
)
from agentenv.proxy.forward import ExchangeCut, ProxyTarget, _relay_body


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return bytes([flags]) + len(payload).to_bytes(4, "big") + payload


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (SandboxState.KILLING, "killed"),
        (None, "killed"),
        (SandboxState.PAUSING, "paused"),
        (SandboxState.PAUSED, "paused"),
        (SandboxState.RUNNING, None),
        (SandboxState.SNAPSHOTTING, None),
        (SandboxState.FORKING, None),
        (SandboxState.RESUMING, None),
    ],
)
def test_which_states_end_traffic(state: SandboxState | None, reason: str | None) -> None:
    assert traffic_end(state) == reason


def test_framing_follows_envelopes_split_anywhere() -> None:
    stream = envelope(b'{"a":1}') + envelope(b"") + envelope(b"x" * 300)
    for cut in range(len(stream) + 1):
        framing = ConnectFraming()
        framing.feed(stream[:cut])
        boundaries = {0, 12, 17, len(stream)}
        assert framing.between_messages == (cut in boundaries), cut
        framing.feed(stream[cut:])
        assert framing.between_messages and not framing.ended
    framing = ConnectFraming()
    framing.feed(envelope(b"{}", flags=0x02))
    assert framing.ended and framing.between_messages


def test_end_stream_error_is_what_connect_clients_read() -> None:
    message = gone_message("sbx1", "killed")
    assert "was not found" in message  # the SDK's SandboxNotRunningException key
    raw = end_stream_error(message)
    assert raw[0] == 0x02 and int.from_bytes(raw[1:5], "big") == len(raw) - 5
    assert json.loads(raw[5:]) == {"error": {"code": "unavailable", "message": message}}
    assert is_connect_stream("application/connect+json")
    assert is_connect_stream("application/connect+proto")
    assert not is_connect_stream("application/json")
    assert not is_connect_stream(None)


async def test_an_ending_fires_once_and_is_replaced() -> None:
    endings = TrafficEndings()
    first = endings.current("a")
    assert endings.current("a") is first and first.reason is None
    endings.end("a", "paused")
    endings.end("a", "killed")  # nothing open since: no effect on the fired one
    assert first.reason == "paused"
    second = endings.current("a")
    assert second is not first and second.reason is None
    endings.end("b", "killed")  # a sandbox without traffic
    assert second.reason is None


class _Upstream(httpx.AsyncByteStream):
    """Sends ``chunks``, then waits forever (a guest that no longer answers)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed = True


async def _relay_until_ended(chunks: list[bytes], content_type: str) -> tuple[list[bytes], bool]:
    """What the client gets when the sandbox is killed once ``chunks`` are relayed, and
    whether the upstream response was closed."""
    body = _Upstream(chunks)
    upstream = httpx.Response(200, headers={"content-type": content_type}, stream=body)
    endings = TrafficEndings()
    ending = endings.current("sbx1")
    framing = ConnectFraming() if is_connect_stream(content_type) else None
    relayed: list[bytes] = []
    relay = _relay_body(upstream, ProxyTarget("sbx1", 49983), ending, framing)
    async with asyncio.timeout(5):
        async for chunk in relay:
            relayed.append(chunk)
            if len(relayed) == len(chunks):
                endings.end("sbx1", "killed")
    return relayed, body.closed


async def test_a_connect_stream_between_messages_ends_with_an_error() -> None:
    first, second = envelope(b'{"event":{"start":{"pid":1}}}'), envelope(b"{}")
    relayed, closed = await _relay_until_ended([first, second], "application/connect+json")
    assert relayed[:2] == [first, second]
    assert relayed[2:] == [end_stream_error(gone_message("sbx1", "killed"))]
    assert closed


async def test_a_connect_stream_mid_message_is_cut() -> None:
    half = envelope(b'{"event":{}}')[:8]
    with pytest.raises(ExchangeCut, match="was not found"):
        await _relay_until_ended([half], "application/connect+json")


async def test_other_bodies_are_cut() -> None:
    with pytest.raises(ExchangeCut):
        await _relay_until_ended([b"part of a download"], "application/octet-stream")


async def test_an_ending_before_the_response_is_not_waited_on() -> None:
    endings = TrafficEndings()
    ending = endings.current("sbx1")
    endings.end("sbx1", "killed")
    body = _Upstream([])
    upstream = httpx.Response(200, headers={"content-type": "application/json"}, stream=body)
    with pytest.raises(ExchangeCut):
        async with asyncio.timeout(5):
            async for _ in _relay_body(upstream, ProxyTarget("sbx1", 49983), ending, None):
                pass
    assert body.closed
