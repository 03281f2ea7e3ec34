"""What the gateway reads itself: a client's control-plane body (bounded, so it can be
sent to a node more than once) and the sandbox ids in nodes' answers (to bind them)."""

from __future__ import annotations

import json

from starlette.requests import Request

from agentenv.limits import MAX_REQUEST_BODY_BYTES


async def read_bounded(request: Request) -> bytes | None:
    """The request body, or None when it exceeds a control-plane request's bound."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_REQUEST_BODY_BYTES:
            return None
    return body


def field_of(data: bytes, name: str) -> str | None:
    try:
        value = json.loads(data).get(name)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def fork_children(data: bytes) -> list[str]:
    try:
        results = json.loads(data)
    except ValueError:
        return []
    children = []
    for result in results if isinstance(results, list) else []:
        sandbox = result.get("sandbox") if isinstance(result, dict) else None
        if isinstance(sandbox, dict) and isinstance(sandbox.get("sandboxID"), str):
            children.append(sandbox["sandboxID"])
    return children
