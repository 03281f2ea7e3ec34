"""What the sync and async clients share: request bodies, response decoding and paging,
so the two differ only in how they wait for I/O."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import TypeVar

import httpx
from pydantic import TypeAdapter, ValidationError

from agentenv.api.models import ForkResult, Health, Lineage, SandboxDetail, SnapshotInfo
from agentenv.client.connection import Connection, SandboxT
from agentenv.client.errors import AgentEnvError, error_for

# Forks and snapshots stop and copy VMs; under TCG a fork of 20 takes tens of seconds.
DEFAULT_REQUEST_TIMEOUT = httpx.Timeout(300.0, connect=10.0)

FORK_RESULTS = TypeAdapter(list[ForkResult])
HEALTH = TypeAdapter(Health)
SANDBOX_DETAIL = TypeAdapter(SandboxDetail)
SANDBOX_DETAILS = TypeAdapter(list[SandboxDetail])
SNAPSHOT = TypeAdapter(SnapshotInfo)
SNAPSHOTS = TypeAdapter(list[SnapshotInfo])

ModelT = TypeVar("ModelT")


@dataclass(frozen=True)
class SnapshotPage:
    """One page of ``GET /snapshots``; ``next_token`` fetches the next, ``None`` at the end."""

    items: list[SnapshotInfo]
    next_token: str | None


def path_part(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def snapshot_id_of(snapshot: str | SnapshotInfo) -> str:
    return snapshot if isinstance(snapshot, str) else snapshot.snapshot_id


def fork_body(count: int, timeout: int | None) -> dict[str, int]:
    if not 1 <= count <= 20:
        raise ValueError(f"count must be between 1 and 20, not {count}")
    body = {"count": count}
    if timeout is not None:
        body["timeout"] = timeout
    return body


def snapshot_query(
    sandbox_id: str | None, name: str | None, limit: int | None, next_token: str | None
) -> dict[str, str | int]:
    query: dict[str, str | int] = {}
    if sandbox_id is not None:
        query["sandboxID"] = sandbox_id
    if name is not None:
        query["name"] = name
    if limit is not None:
        query["limit"] = limit
    if next_token is not None:
        query["nextToken"] = next_token
    return query


def decode(adapter: TypeAdapter[ModelT], response: httpx.Response) -> ModelT:
    """The response body as the adapter's type; a body that does not fit is the server's
    fault and reported as an ``AgentEnvError`` rather than a Pydantic one."""
    try:
        return adapter.validate_json(response.content)
    except ValidationError as exc:
        raise AgentEnvError(
            response.status_code,
            f"unexpected response from {response.request.url}: {exc.error_count()} problem(s), "
            f"first: {exc.errors()[0]['msg']}",
        ) from exc


def snapshot_page(response: httpx.Response) -> SnapshotPage:
    items = decode(SNAPSHOTS, response)
    return SnapshotPage(items=items, next_token=response.headers.get("X-Next-Token") or None)


def fork_children(
    response: httpx.Response, connection: Connection, cls: type[SandboxT]
) -> list[SandboxT | AgentEnvError]:
    """One SDK sandbox per started child, in order, and an ``AgentEnvError`` in the place
    of each child that did not start."""
    children: list[SandboxT | AgentEnvError] = []
    for result in decode(FORK_RESULTS, response):
        if result.sandbox is not None:
            children.append(connection.sdk_sandbox(cls, result.sandbox))
        elif result.error is not None:
            children.append(error_for(result.error.code, result.error.message))
        else:
            children.append(AgentEnvError(None, "fork child reported neither sandbox nor error"))
    return children


def lineage_of(detail: SandboxDetail) -> Lineage:
    # A server predating lineage reports none; the sandbox then has only its source.
    return detail.lineage or Lineage(sourceID=detail.template_id)
