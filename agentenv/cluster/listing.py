"""Listings across nodes: every node's page merged into the cluster's page.

A node pages ``GET /v2/sandboxes`` by the position (startedAt, sandboxID) in the
requested order (``agentenv.api.listing``; its ``X-Next-Token`` encodes the position).
The gateway asks every node for the same page (same token, order and limit): the
cluster's next ``limit`` sandboxes are among the union of the nodes' next ``limit``, so
merging those by the same position and cutting at ``limit`` gives the page one node
holding everything would have given, and a token every node understands.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from agentenv.api.listing import Order, Position, encode_token, position

NEXT_TOKEN_HEADER = "x-next-token"


def sandbox_key(item: dict[str, Any]) -> Position:
    """The node's page position of a sandbox detail (``api.listing.sandbox_key`` over
    JSON)."""
    return position(datetime.fromisoformat(str(item["startedAt"])), str(item["sandboxID"]))


def merge_pages(
    pages: Iterable[Sequence[dict[str, Any]]], order: Order, limit: int, more_on_a_node: bool
) -> tuple[list[dict[str, Any]], str | None]:
    """The cluster's page from the nodes' ``pages`` (each sorted or not), and the token
    of the next page, if there is one. ``more_on_a_node``: some node said it has more
    than it sent."""
    every = (item for page in pages for item in page)
    items = sorted(every, key=sandbox_key, reverse=order == "desc")
    if len(items) > limit or (more_on_a_node and items):
        items = items[:limit]
        return items, encode_token(order, sandbox_key(items[-1]))
    return items, None
