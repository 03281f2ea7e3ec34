"""Ending a sandbox's proxied traffic at once when the sandbox is killed, expires or is
paused.

A killed or paused guest never answers again and never resets its connections, so a
stream open into it (process output, a directory watch, a download) would wait until
the client's own deadline, or forever. The orchestrator tells the proxy when a sandbox
stops taking traffic (:meth:`Orchestrator.on_traffic_end`); every exchange in flight
holds the sandbox's :class:`Ending` and stops when it fires.

How an exchange stops, so that the e2b SDK raises its sandbox-not-running error:

- before the guest's response: the answer is the proxy's 502 "The sandbox ... was not
  found", as for any request to a sandbox that is gone;
- a Connect stream (``application/connect+*``) cut between messages: the stream ends
  with a Connect end-of-stream message carrying an ``unavailable`` error with that same
  message, which the SDK maps to ``SandboxNotRunningException`` without probing;
- anything else (mid-message, downloads, other ports): the client's connection is
  dropped, and the SDK's follow-up ``/health`` probe gets the 502.
"""

from __future__ import annotations

import asyncio
import json

#: Connect envelope flags (connectrpc.com/docs/protocol, "Streaming-RPC").
_END_STREAM_FLAG = 0x02
_ENVELOPE_HEADER_BYTES = 5


def gone_message(sandbox_id: str, reason: str) -> str:
    """What the proxy says about a sandbox that no longer takes traffic. E2B's edge says
    "was not found" for a killed, expired or paused sandbox, and the SDK keys its
    ``SandboxNotRunningException`` on those words."""
    return f"The sandbox {sandbox_id} was not found: it was {reason}"


class Ending:
    """One sandbox's end of traffic, as seen by the exchanges that started before it."""

    def __init__(self) -> None:
        self._reason: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def fire(self, reason: str) -> None:
        if not self._reason.done():
            self._reason.set_result(reason)

    @property
    def reason(self) -> str | None:
        return self._reason.result() if self._reason.done() else None

    def future(self) -> asyncio.Future[str]:
        """For ``asyncio.wait`` beside the exchange's own work (never cancel it)."""
        return self._reason


class TrafficEndings:
    """The current :class:`Ending` of every sandbox with traffic. An ending fires once
    and is forgotten, so traffic after a resume gets a new one."""

    def __init__(self) -> None:
        self._current: dict[str, Ending] = {}

    def current(self, sandbox_id: str) -> Ending:
        """The ending an exchange admitted now must stop at. Take it in the same step
        (no ``await`` in between) as the check that found the sandbox running: an end
        that fires after that check then always reaches the exchange."""
        ending = self._current.get(sandbox_id)
        if ending is None:
            ending = self._current[sandbox_id] = Ending()
        return ending

    def end(self, sandbox_id: str, reason: str) -> None:
        ending = self._current.pop(sandbox_id, None)
        if ending is not None:
            ending.fire(reason)


class ConnectFraming:
    """Follows the envelopes of a relayed Connect stream (a flags byte, a 4-byte
    big-endian length, then the message) to tell whether the bytes relayed so far end
    between messages, where an end-of-stream message may still be added."""

    def __init__(self) -> None:
        self._header = bytearray()
        self._body_left = 0
        self.ended = False

    def feed(self, data: bytes) -> None:
        position, size = 0, len(data)
        while position < size:
            if self._body_left:
                step = min(self._body_left, size - position)
                self._body_left -= step
                position += step
                continue
            take = data[position : position + _ENVELOPE_HEADER_BYTES - len(self._header)]
            self._header += take
            position += len(take)
            if len(self._header) == _ENVELOPE_HEADER_BYTES:
                if self._header[0] & _END_STREAM_FLAG:
                    self.ended = True
                self._body_left = int.from_bytes(self._header[1:], "big")
                self._header.clear()

    @property
    def between_messages(self) -> bool:
        return not self._body_left and not self._header


def end_stream_error(message: str) -> bytes:
    """A Connect end-of-stream message with an ``unavailable`` error (always JSON,
    whatever the stream's codec)."""
    body = json.dumps({"error": {"code": "unavailable", "message": message}}).encode()
    return bytes([_END_STREAM_FLAG]) + len(body).to_bytes(4, "big") + body


def is_connect_stream(content_type: str | None) -> bool:
    return (content_type or "").lower().startswith("application/connect+")
