"""The HTTP/1.1 protocol every agentenv server (node, gateway, scheduler) hands uvicorn
(``uvicorn.run(http=...)``): httptools' C parser (llhttp) rather than the pure-Python h11,
with two things uvicorn's own httptools protocol lacks:

- a request it cannot parse (a malformed request line, target or header, refused before
  the app sees it) is answered with the API's JSON ``{code, message}`` error rather than
  uvicorn's plain text, so that every answer of the API is JSON;
- a bounded request head. llhttp puts no limit on a head's size, and uvicorn's httptools
  protocol keeps whatever it is sent (a 20 MiB header is handed to the app whole), so a
  client could make a server hold any amount of memory before authentication. Here a head
  is bounded by the ``h11_max_incomplete_event_size`` uvicorn is given (h11's own default,
  16 KiB, when it is not), the setting the h11 protocol applies; a longer one is answered
  with a JSON 431 and the connection closed;
- a request target that is not a path (absolute-form) reaches the app whole, as with h11,
  not cut down to its path.

The gateway and the scheduler run it on uvloop, the node on asyncio's own loop (see
agentenv/server.py); README, Benchmarks, has what each saves.
"""

from __future__ import annotations

import http
import json
from typing import Any, Final

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

# h11's default bound on an incomplete event (a request head), which uvicorn's h11
# protocol applies when h11_max_incomplete_event_size is not given.
DEFAULT_MAX_HEAD_BYTES: Final = 16 * 1024


class JsonErrorsHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with JSON parse errors and a bounded request head."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: Any = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.max_head_bytes: int = config.h11_max_incomplete_event_size or DEFAULT_MAX_HEAD_BYTES
        # The reads that held part of the current request's head, counted once parsed
        # (so that a read carrying a head and the start of its body is not held against
        # the head). A read carrying the end of one pipelined request and the start of
        # the next counts whole: the bound holds to within one read (at most 256 KiB).
        self.head_bytes = 0
        self.reading_head = False

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.reading_head and not self.transport.is_closing():
            self.head_bytes += len(data)
            if self.head_bytes > self.max_head_bytes:
                self.refuse(431, f"request head exceeds {self.max_head_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.reading_head = True
        self.head_bytes = 0

    def on_headers_complete(self) -> None:
        self.reading_head = False
        target = self.url
        super().on_headers_complete()
        if target[:1] != b"/" and "raw_path" in self.scope:
            # A target that is not a path (absolute-form `http://host/x`): llhttp's URL
            # parser keeps only its path, which would hide from the app that the
            # request named a host of its own. As uvicorn's h11 protocol does, the app
            # gets the target whole, so that the proxy's path check refuses it (400).
            # The request's task has not run yet; it reads this same scope.
            raw_path = target.partition(b"?")[0]
            self.scope["raw_path"] = raw_path
            self.scope["path"] = raw_path.decode("latin-1")

    def send_400_response(self, msg: str) -> None:
        self.refuse(400, msg)

    def refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with a JSON error and close the connection (what was read of
        the request cannot be trusted to say where the next one begins)."""
        body = json.dumps({"code": status, "message": message}).encode()
        head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode()]
        head += [name + b": " + value for name, value in self.server_state.default_headers]
        head += [
            b"content-type: application/json",
            b"content-length: " + str(len(body)).encode(),
            b"connection: close",
        ]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()
