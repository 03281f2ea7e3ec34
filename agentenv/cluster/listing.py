"""Listings across nodes: every node's page merged into the cluster's page.

A node pages ``GET /v2/sandboxes`` by the key ``{startedAt}|{sandboxID}`` (its
``X-Next-Token``). The gateway asks every node for the same page (same token and limit):
the cluster's next ``limit`` sandboxes are among the union of the nodes' next ``limit``,
so merging those by the same key and cutting at ``limit`` gives the page one node
holding everything would have given, and a token every node understands.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

NEXT_TOKEN_HEADER = "x-next-token"


def sandbox_key(item: dict[str, Any]) -> str:
    """The node's page key of a sandbox detail (``api.paging.sandbox_key`` over JSON)."""
    started = datetime.fromisoformat(str(item["startedAt"]))
    return started.isoformat() + "|" + str(item["sandboxID"])


def merge_pages(
    pages: Iterable[Sequence[dict[str, Any]]], limit: int | None, more_on_a_node: bool
) -> tuple[list[dict[str, Any]], str | None]:
    """The cluster's page from the nodes' ``pages`` (each sorted or not), and the token
    of the next page, if there is one. ``more_on_a_node``: some node said it has more
    than it sent."""
    items = sorted((item for page in pages for item in page), key=sandbox_key)
    if limit is None:
        return items, None
    if len(items) > limit or (more_on_a_node and items):
        items = items[:limit]
        return items, sandbox_key(items[-1])
    return items, None
