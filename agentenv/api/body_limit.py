"""A bound on control-plane request bodies, checked before they are read whole: without
it a 10 MiB JSON body is parsed before its fields' limits refuse it."""

from __future__ import annotations

import json
import re

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimitMiddleware:
    """Answers 413 (JSON) to a request whose body is larger than ``limit`` bytes: at
    once when its ``Content-Length`` says so, else when the body read so far passes it
    (an ``HTTPException`` the application's handlers turn into the same answer).
    Requests whose path matches ``exempt`` (streamed uploads) are not bound."""

    def __init__(self, app: ASGIApp, limit: int, exempt: re.Pattern[str]) -> None:
        self.app = app
        self.limit = limit
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.exempt.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(send)
                return
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, bounded, send)

    def _message(self) -> str:
        return f"request body larger than {self.limit} bytes"

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"code": 413, "message": self._message()}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
