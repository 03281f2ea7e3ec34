"""How the gateway reaches nodes: an ``httpx`` transport (the one seam every node request
goes through, relayed or the gateway's own) carried by aiohttp's client.

httpcore's pool, under httpx's default transport, walks every pooled connection (and polls
each idle one's socket) on each request and each answer's end: with the connections a
busy gateway keeps open to its nodes, that walk was most of the gateway's CPU per relayed
request (``bench/cluster.py``). aiohttp keeps idle connections per host and takes one in
constant time; its HTTP parser is C.

What a relay needs from a client is set here once: no cookie jar, no redirects, no
decompression (bytes go on as the node sent them), none of the client's own headers
(the request's are sent as they are, Host included), the body streamed both ways.
Failures come out as ``httpx`` errors, so the gateway maps them as before.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
from multidict import CIMultiDict
from yarl import URL

# aiohttp's parser refuses a head line or header over 8190 bytes and more than 128
# headers; httpcore (h11) took any head up to 16 KiB. A node's answer relayed before is
# relayed still.
_MAX_FIELD_BYTES = 64 * 1024
_MAX_HEADERS = 1024
# Headers aiohttp would add to a request that lacks them; a relayed request has what its
# client sent and no more.
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


class AiohttpNodeTransport(httpx.AsyncBaseTransport):
    """Requests to nodes over one aiohttp connection pool; https nodes verified with
    ``tls``. The session is made on first use, in the loop that serves the gateway."""

    def __init__(
        self, tls: ssl.SSLContext, *, max_connections: int = 1000, keepalive_s: float = 30.0
    ) -> None:
        self._tls = tls
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[tuple[Any, Any], aiohttp.ClientTimeout] = {}

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                ssl=self._tls,
                limit=self._max_connections,
                limit_per_host=0,
                keepalive_timeout=self._keepalive_s,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=_NO_AUTO_HEADERS,
                timeout=aiohttp.ClientTimeout(total=None),
                trust_env=False,
                max_line_size=_MAX_FIELD_BYTES,
                max_field_size=_MAX_FIELD_BYTES,
                max_headers=_MAX_HEADERS,
            )
        return self._session

    def _timeout(self, request: httpx.Request) -> aiohttp.ClientTimeout:
        """httpx's per-request timeouts (``connect``, ``read``) as aiohttp's."""
        given = request.extensions.get("timeout") or {}
        key = (given.get("connect"), given.get("read"))
        found = self._timeouts.get(key)
        if found is None:
            found = self._timeouts[key] = aiohttp.ClientTimeout(
                total=None, sock_connect=key[0], sock_read=key[1]
            )
        return found

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        # aiohttp frames a body of unknown length itself (chunked), and refuses a
        # Transfer-Encoding given with one.
        headers = CIMultiDict(
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.headers.raw
            if k.lower() != b"transfer-encoding"
        )
        tls = url.scheme == "https"
        try:
            answer = await self._open().request(
                request.method,
                # Encoded as it came: the raw path and query go on unchanged.
                URL(str(url), encoded=True),
                headers=headers,
                data=_body(request.stream),
                allow_redirects=False,
                timeout=self._timeout(request),
                # The certificate names the node (its URL's host), whatever Host says.
                server_hostname=url.host if tls else None,
            )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"timed out ({url.netloc.decode()})") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        return httpx.Response(
            answer.status,
            headers=list(answer.raw_headers),
            stream=_AnswerBody(answer),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _body(stream: httpx.SyncByteStream | httpx.AsyncByteStream) -> Any:
    """A request body as aiohttp takes it: bytes when it is whole, else streamed."""
    if isinstance(stream, httpx.ByteStream):
        return b"".join(stream) or None
    if not isinstance(stream, httpx.AsyncByteStream):
        raise TypeError("a node request's body must be async")

    async def chunks() -> AsyncIterator[bytes]:
        async for chunk in stream:
            yield chunk

    return chunks()


class _AnswerBody(httpx.AsyncByteStream):
    """A node's answer body as it arrives. Closed before its end, its connection is
    closed rather than reused (what is left of the body would come first on it)."""

    def __init__(self, answer: aiohttp.ClientResponse) -> None:
        self._answer = answer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._answer.content.iter_any():
                yield chunk
        except TimeoutError as exc:
            raise httpx.ReadTimeout("the node's answer timed out") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__) from exc

    async def aclose(self) -> None:
        if self._answer.content.is_eof():
            self._answer.release()
        else:
            self._answer.close()
