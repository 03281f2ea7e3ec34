"""What the gateway reads itself: a client's control-plane body (bounded, so it can be
sent to a node more than once), the sandbox ids in nodes' answers (to bind them) and
their refusals of another mode; and a node's answer it read, replayed to the client."""

from __future__ import annotations

import json

import httpx
from starlette.requests import Request
from starlette.responses import Response

from agentenv.limits import MAX_REQUEST_BODY_BYTES
from agentenv.proxy.relay import response_headers


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


def mode_mismatch(upstream: httpx.Response, data: bytes) -> bool:
    """Whether a node refused because what was asked for was saved under another VMM or
    accelerator than it runs (a node of that mode would take it)."""
    return upstream.status_code == 409 and field_of(data, "error_code") == "mode_mismatch"


def capacity_refused(upstream: httpx.Response, data: bytes) -> bool:
    """Whether a node refused a start for what its host can hold now (503
    capacity_exhausted: its lending limit, its memory reserve or its memory stalls), which
    the scheduler, placing on heartbeats, cannot see coming; another node may take it."""
    return upstream.status_code == 503 and field_of(data, "error_code") == "capacity_exhausted"


def replay(upstream: httpx.Response, data: bytes) -> Response:
    """A node's answer the gateway read whole, for the client. The node's Date is left
    out: uvicorn adds the gateway's."""
    headers = {k: v for k, v in response_headers(upstream).items() if k.lower() != "date"}
    return Response(data, status_code=upstream.status_code, headers=headers)
