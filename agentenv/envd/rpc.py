"""What envd wraps around connectrpc's ASGI applications so bad requests and deadlines
get the Connect codes E2B's Go envd (connect-go) gives them.

envd is pinned to connectrpc 0.12 because the E2B SDK is, and that release's server
leaves three things to the application:

* a body that does not decode reaches the client as ``unknown`` (HTTP 500) rather than
  ``invalid_argument`` -> :class:`StrictCodec`;
* a streaming request body that ends partway through an envelope is silently cut,
  so a truncated ``Start`` is reported as "zero messages" -> :class:`EnvelopeCheck`;
* the ``connect-timeout-ms`` deadline is parsed but never enforced, so a stream ran
  past it and ended as a success -> :class:`DeadlineInterceptor`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_Req = TypeVar("_Req")
_Res = TypeVar("_Res")
_Ctx = RequestContext[Any, Any]

#: Content types whose bodies are enveloped messages (Connect streaming, gRPC, gRPC-Web).
ENVELOPED_CONTENT_TYPES = ("application/connect+", "application/grpc")
#: The only request flag a client may set: "compressed". End-of-stream is server-only.
_CLIENT_FLAGS = 0b01
_HEADER_SIZE = 5


class StrictCodec:
    """A codec whose decode failures are the client's fault: ``invalid_argument``."""

    def __init__(self, inner: Codec[Any, Any]) -> None:
        self._inner = inner

    def name(self) -> str:
        return self._inner.name()

    def encode(self, message: Any) -> bytes:
        return self._inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as e:
            raise ConnectError(Code.INVALID_ARGUMENT, f"unmarshal message: {e}") from None


def strict_codecs() -> list[Codec[Any, Any]]:
    """connectrpc's default codecs (binary and JSON protobuf), made strict."""
    return [StrictCodec(proto_binary_codec()), StrictCodec(proto_json_codec())]


class EnvelopeFraming:
    """Follows the envelope boundaries of a request body fed to it chunk by chunk."""

    def __init__(self) -> None:
        self._header = bytearray()
        self._body_left = 0
        self._body_size = 0

    def feed(self, chunk: bytes) -> None:
        """Account for ``chunk``; raise ``invalid_argument`` on a flag no client may set."""
        view = memoryview(chunk)
        while view:
            if self._body_left:
                taken = min(self._body_left, len(view))
                self._body_left -= taken
                view = view[taken:]
                continue
            taken = min(_HEADER_SIZE - len(self._header), len(view))
            self._header += view[:taken]
            view = view[taken:]
            if len(self._header) == _HEADER_SIZE:
                if self._header[0] & ~_CLIENT_FLAGS:
                    raise ConnectError(
                        Code.INVALID_ARGUMENT, "protocol error: invalid envelope flags"
                    )
                self._body_size = self._body_left = int.from_bytes(self._header[1:], "big")
                self._header.clear()

    def finish(self) -> None:
        """Raise ``invalid_argument`` if the body ended inside an envelope."""
        if self._body_left:
            got = self._body_size - self._body_left
            raise ConnectError(
                Code.INVALID_ARGUMENT,
                f"protocol error: promised {self._body_size} bytes in enveloped message, "
                f"got {got} bytes",
            )
        if self._header:
            raise ConnectError(
                Code.INVALID_ARGUMENT, "protocol error: incomplete envelope: unexpected EOF"
            )


class EnvelopeCheck:
    """ASGI middleware: a streaming request whose body breaks the envelope framing fails
    with ``invalid_argument`` instead of being cut at the last whole message.

    The error is raised from ``receive()``, where connectrpc's stream reader turns it into
    the stream's end status.
    """

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_enveloped(scope):
            await self._app(scope, receive, send)
            return
        framing = EnvelopeFraming()
        body_done = False

        async def checked_receive() -> Message:
            nonlocal body_done
            message = await receive()
            if message["type"] == "http.request" and not body_done:
                framing.feed(message.get("body", b""))
                if not message.get("more_body", False):
                    body_done = True
                    framing.finish()
            return message

        await self._app(scope, checked_receive, send)


def _is_enveloped(scope: Scope) -> bool:
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-type":
            content_type: str = value.decode("latin-1").lower()
            return content_type.startswith(ENVELOPED_CONTENT_TYPES)
    return False


class DeadlineInterceptor:
    """Ends every RPC at its ``connect-timeout-ms`` deadline with ``deadline_exceeded``.

    A handler is cancelled where it waits; a stream is also checked between messages,
    so one that never waits still stops.
    """

    async def intercept_unary(
        self,
        call_next: Callable[[_Req, _Ctx], Awaitable[_Res]],
        request: _Req,
        ctx: _Ctx,
        /,
    ) -> _Res:
        return await _within_deadline(call_next(request, ctx), _deadline(ctx))

    async def intercept_client_stream(
        self,
        call_next: Callable[[AsyncIterator[_Req], _Ctx], Awaitable[_Res]],
        request: AsyncIterator[_Req],
        ctx: _Ctx,
        /,
    ) -> _Res:
        return await _within_deadline(call_next(request, ctx), _deadline(ctx))

    async def intercept_server_stream(
        self,
        call_next: Callable[[_Req, _Ctx], AsyncIterator[_Res]],
        request: _Req,
        ctx: _Ctx,
        /,
    ) -> AsyncIterator[_Res]:
        deadline = _deadline(ctx)
        stream = call_next(request, ctx)
        try:
            while True:
                try:
                    message = await _within_deadline(anext(stream), deadline)
                except StopAsyncIteration:
                    return
                yield message
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


def _deadline(ctx: _Ctx) -> float | None:
    """The request's deadline on the event loop's clock, if it has one."""
    remaining_ms = ctx.timeout_ms
    if remaining_ms is None:
        return None
    return asyncio.get_running_loop().time() + remaining_ms / 1000


async def _within_deadline(step: Awaitable[_Res], deadline: float | None) -> _Res:
    if deadline is None:
        return await step
    if asyncio.get_running_loop().time() >= deadline:
        if asyncio.iscoroutine(step):
            step.close()  # never started; closing avoids "was never awaited"
        raise _deadline_exceeded()
    try:
        async with asyncio.timeout_at(deadline):
            return await step
    except TimeoutError:
        raise _deadline_exceeded() from None


def _deadline_exceeded() -> ConnectError:
    return ConnectError(Code.DEADLINE_EXCEEDED, "Request timed out")
