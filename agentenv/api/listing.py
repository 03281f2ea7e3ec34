"""Listings and their pages (``GET /v2/sandboxes``, ``GET /sandboxes``, ``GET /snapshots``).

What E2B does, and where it says so:

- ``order`` is ``asc`` or ``desc`` by start time, ``desc`` (newest first) when absent,
  applied to the whole filtered result before it is cut into pages; any other value is a
  400. (E2B's ``spec/openapi.yml``, ``OrderDirection`` "default: desc", and
  ``parseSandboxListOrder`` in ``packages/api/internal/handlers/sandboxes_list.go`` of
  e2b-dev/infra; the SDK 2.63 sends ``order`` only when given:
  ``e2b/sandbox_sync/paginator.py``.)
- ``startedAfter`` keeps the sandboxes started at or after it (same spec: "at or after",
  ``format: date-time``). The SDK sends ``started_after.astimezone().isoformat()``, so
  always with an offset (``e2b/api/client/api/sandboxes/get_v2_sandboxes.py``).
- ``template`` is a template id or alias (spec: "Filter sandboxes by a template ID or
  alias"); one that names no template lists nothing, not an error (``templateFilterNoMatch``
  in the same handler).
- ``limit`` defaults to 100 (spec: ``paginationLimit``, "default: 100"); the SDK sends it
  only when given. Here it may go up to ``MAX_PAGE_SIZE``.
- ``nextToken`` is a keyset position, (start time, id) of the last item served, with the
  order it was served in: a token replayed under the other order is a 400, as in E2B
  (``parseCursorToken`` in ``packages/api/internal/utils/pagination.go``). A position
  rather than an offset is what keeps pages stable while sandboxes come and go: the next
  page is whatever sorts after the position, so a sandbox created between two pages
  neither repeats an item nor shifts one out of the listing.

Tokens are URL-safe base64 (no padding) of ``{order}|{time}|{id}``: opaque to clients,
and free of ``+``, which a token pasted into a URL unencoded would lose.
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.parse
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal, TypeVar

from fastapi import APIRouter, Query, Response
from fastapi.params import Depends
from pydantic import AwareDatetime

from agentenv.api.errors import ApiError
from agentenv.api.models import SandboxDetail, SnapshotInfo
from agentenv.api.params import NextToken
from agentenv.limits import (
    ID_PATTERN,
    MAX_ID_LENGTH,
    MAX_METADATA_BYTES,
    MAX_PAGE_SIZE,
    MAX_SNAPSHOT_NAME_LENGTH,
    MAX_TEMPLATE_REF_LENGTH,
    TEMPLATE_REF_PATTERN,
)
from agentenv.orchestrator.errors import SnapshotNotFound
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.views import SandboxView, SnapshotView

V = TypeVar("V")

Order = Literal["asc", "desc"]
DEFAULT_ORDER: Order = "desc"
# E2B's default page size for GET /v2/sandboxes.
DEFAULT_SANDBOX_PAGE_SIZE = 100

_ID = re.compile(ID_PATTERN)
_NOT_A_TOKEN = "nextToken: not a page token of this server (use X-Next-Token)"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)

# A listed item's position: its time in whole microseconds since the epoch (exact, unlike
# a float timestamp) and its id, which breaks ties between items started together.
Position = tuple[int, str]

OrderParam = Annotated[
    Order | None,
    Query(
        description="by start time: `asc` (oldest first) or `desc` (newest first, the "
        "default, as in E2B); applied to the whole listing before it is paged",
    ),
]
StartedAfterParam = Annotated[
    AwareDatetime | None,
    Query(
        alias="startedAfter",
        description="only sandboxes started at or after this time (RFC 3339 with an "
        "offset, as the SDK's `SandboxQuery.started_after` sends it)",
    ),
]
TemplateParam = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=MAX_TEMPLATE_REF_LENGTH,
        pattern=TEMPLATE_REF_PATTERN,
        description="only sandboxes started from this template (or snapshot), by id or "
        "name; a name that matches nothing lists nothing",
    ),
]
SandboxLimitParam = Annotated[
    int,
    Query(
        ge=1,
        le=MAX_PAGE_SIZE,
        description=f"most items on a page (default {DEFAULT_SANDBOX_PAGE_SIZE}, as in E2B)",
    ),
]


def position(when: datetime, item_id: str) -> Position:
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return ((when - _EPOCH) // _MICROSECOND, item_id)


def encode_token(order: Order, pos: Position) -> str:
    when = _EPOCH + pos[0] * _MICROSECOND
    raw = f"{order}|{when.isoformat()}|{pos[1]}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_token(token: str, order: Order) -> Position:
    """The position ``token`` holds; a 400 if this server cannot have given it for
    ``order``: ignoring it would answer the first page, and a client would loop over it."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        token_order, when_text, item_id = raw.split("|", 2)
        when = datetime.fromisoformat(when_text)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise ApiError(400, _NOT_A_TOKEN) from None
    if token_order not in ("asc", "desc") or not _ID.fullmatch(item_id) or when.tzinfo is None:
        raise ApiError(400, _NOT_A_TOKEN)
    if token_order != order:
        raise ApiError(400, f"nextToken: given for order={token_order}, not order={order}")
    return position(when, item_id)


def page(
    items: Sequence[V],
    key: Callable[[V], Position],
    order: Order,
    next_token: str | None,
    limit: int | None,
    response: Response,
) -> list[V]:
    """One page of ``items``: sorted by ``key`` in ``order`` (all of them, before any
    cut), those after ``next_token``'s position, at most ``limit``, with the token of the
    next page in ``X-Next-Token`` when there is one."""
    descending = order == "desc"
    ordered = sorted(items, key=key, reverse=descending)
    if next_token is not None:
        after = decode_token(next_token, order)
        ordered = [i for i in ordered if (key(i) < after if descending else key(i) > after)]
    if limit is not None and len(ordered) > limit:
        ordered = ordered[:limit]
        response.headers["X-Next-Token"] = encode_token(order, key(ordered[-1]))
    return ordered


def sandbox_key(view: SandboxView) -> Position:
    return position(view.record.started_at, view.sandbox_id)


def snapshot_key(view: SnapshotView) -> Position:
    return position(view.record.created_at, view.snapshot_id)


def started_at_or_after(views: list[SandboxView], when: datetime) -> list[SandboxView]:
    # Compared on the microsecond grid the positions use, so that a sandbox's own
    # startedAt given back keeps that sandbox (E2B truncates the bound the same way).
    bound = position(when, "")[0]
    return [v for v in views if sandbox_key(v)[0] >= bound]


def parse_states(state: str) -> set[str]:
    """``state`` as the SDK sends it: comma-joined ``running`` and ``paused``."""
    wanted = {s.strip() for s in state.split(",") if s.strip()}
    unknown = wanted - {"running", "paused"}
    if unknown:
        raise ApiError(400, f"state: unknown value(s) {', '.join(sorted(unknown))}")
    return wanted


def listing_routes(
    orchestrator: Orchestrator,
    authed: Sequence[Depends],
    detail_body: Callable[[SandboxView], SandboxDetail],
    snapshot_body: Callable[[SnapshotView], SnapshotInfo],
) -> APIRouter:
    """``GET /sandboxes``, ``GET /v2/sandboxes`` and ``GET /snapshots``."""
    router = APIRouter()

    @router.get(
        "/sandboxes",
        response_model=list[SandboxDetail],
        response_model_by_alias=True,
        # Optional fields are left out rather than null: the SDK parses a present
        # `pauseMode` (and others) as a value.
        response_model_exclude_none=True,
        dependencies=list(authed),
        tags=["sandboxes"],
    )
    async def list_sandboxes_v1() -> list[SandboxDetail]:
        # Newest first, as E2B's (GetSandboxes in e2b-dev/infra's sandboxes_list.go).
        views = sorted(orchestrator.list_sandboxes(), key=sandbox_key, reverse=True)
        return [detail_body(v) for v in views]

    @router.get(
        "/v2/sandboxes",
        response_model=list[SandboxDetail],
        response_model_by_alias=True,
        # Optional fields are left out rather than null: the SDK parses a present
        # `pauseMode` (and others) as a value.
        response_model_exclude_none=True,
        dependencies=list(authed),
        tags=["sandboxes"],
    )
    async def list_sandboxes_v2(
        response: Response,
        metadata: Annotated[
            str | None,
            Query(
                max_length=3 * MAX_METADATA_BYTES,
                description="only sandboxes with all these metadata entries: "
                "`k=v&k2=v2`, keys and values URL-quoted (as the SDK sends it)",
            ),
        ] = None,
        state: Annotated[
            str | None,
            Query(max_length=64, description="`running`, `paused` or both, comma-joined"),
        ] = None,
        order: OrderParam = None,
        started_after: StartedAfterParam = None,
        template: TemplateParam = None,
        limit: SandboxLimitParam = DEFAULT_SANDBOX_PAGE_SIZE,
        next_token: NextToken = None,
    ) -> list[SandboxDetail]:
        views = orchestrator.list_sandboxes()
        if state:
            wanted = parse_states(state)
            views = [v for v in views if v.state in wanted]
        if metadata:
            # The SDK quotes keys and values, then encodes the whole string once more.
            wanted_meta = {
                urllib.parse.unquote(k): urllib.parse.unquote(v)
                for k, v in urllib.parse.parse_qsl(metadata, keep_blank_values=True)
            }
            views = [
                v
                for v in views
                if all(v.record.metadata.get(k) == val for k, val in wanted_meta.items())
            ]
        if started_after is not None:
            views = started_at_or_after(views, started_after)
        if template is not None:
            ids = await template_ids(template)
            views = [v for v in views if v.record.template_id in ids]
        chosen = order or DEFAULT_ORDER
        return [
            detail_body(v) for v in page(views, sandbox_key, chosen, next_token, limit, response)
        ]

    async def template_ids(ref: str) -> set[str]:
        """The ids ``ref`` may stand for: itself, and the template or snapshot it names.
        Sandboxes record the id they started from (a name resolved at create)."""
        ids = {ref}
        for kind in ("template", "snapshot"):
            try:
                ids.add((await orchestrator.get_snapshot(ref, type_=kind)).snapshot_id)
            except SnapshotNotFound:
                pass
        return ids

    @router.get(
        "/snapshots",
        response_model=list[SnapshotInfo],
        response_model_by_alias=True,
        dependencies=list(authed),
        tags=["snapshots"],
    )
    async def list_snapshots(
        response: Response,
        sandbox_id: Annotated[
            str | None, Query(alias="sandboxID", max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)
        ] = None,
        name: Annotated[str | None, Query(max_length=MAX_SNAPSHOT_NAME_LENGTH)] = None,
        limit: Annotated[int | None, Query(ge=1, le=MAX_PAGE_SIZE)] = None,
        next_token: NextToken = None,
    ) -> list[SnapshotInfo]:
        views = await orchestrator.list_snapshots(sandbox_id)
        if name:
            views = [v for v in views if name in v.names]
        # Newest first, as E2B's (snapshot_template_list.go: its pagination's default order).
        chosen = DEFAULT_ORDER
        return [
            snapshot_body(v) for v in page(views, snapshot_key, chosen, next_token, limit, response)
        ]

    return router
