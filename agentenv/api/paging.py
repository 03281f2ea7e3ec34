"""Pages of a listing (``GET /v2/sandboxes``, ``GET /snapshots``): items sorted by a key,
the key of the last item on a page given back as ``X-Next-Token``."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

from fastapi import Response

from agentenv.api.errors import ApiError
from agentenv.limits import ID_PATTERN
from agentenv.orchestrator.views import SandboxView, SnapshotView

V = TypeVar("V")

_ID = re.compile(ID_PATTERN)


def page(
    items: list[V],
    key: Callable[[V], str],
    next_token: str | None,
    limit: int | None,
    response: Response,
) -> list[V]:
    """One page of ``items`` (sorted by ``key``): those after ``next_token``, at most
    ``limit``, with the token of the next page in ``X-Next-Token`` when there is one.
    A token this server cannot have given is a 400: ignoring it would answer the first
    page, and a client would loop over it."""
    if next_token is not None:
        # A token pasted into a URL unencoded has its "+" (the time's offset) read as a
        # space; tokens hold no spaces, so it is taken back.
        next_token = next_token.replace(" ", "+")
        check_token(next_token)
        items = [item for item in items if key(item) > next_token]
    if limit is not None and len(items) > limit:
        items = items[:limit]
        response.headers["X-Next-Token"] = key(items[-1])
    return items


def check_token(token: str) -> None:
    when, _, item_id = token.partition("|")
    try:
        datetime.fromisoformat(when)
    except ValueError:
        item_id = ""
    if not _ID.fullmatch(item_id):
        raise ApiError(400, "nextToken: not a page token of this server (use X-Next-Token)")


def snapshot_key(view: SnapshotView) -> str:
    return view.record.created_at.isoformat() + "|" + view.snapshot_id


def sandbox_key(view: SandboxView) -> str:
    return view.record.started_at.isoformat() + "|" + view.sandbox_id
