"""What the sync and async clients share: request bodies, response decoding and paging,
so the two differ only in how they wait for I/O."""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import httpx
from pydantic import TypeAdapter, ValidationError

from agentenv.api.models import (
    ForkResult,
    Health,
    Lineage,
    SandboxDetail,
    SnapshotInfo,
    TemplateInfo,
)
from agentenv.api.models import Sandbox as SandboxBody
from agentenv.client.connection import Connection, SandboxT
from agentenv.client.errors import AgentEnvError, AuthError, error_for
from agentenv.limits import MAX_FORK_CHILDREN, MAX_REFRESH_DURATION_S

# Forks and snapshots stop and copy VMs; under TCG a fork of MAX_FORK_CHILDREN takes tens
# of seconds. Connecting must fail fast, so that an unreachable server is reported promptly.
DEFAULT_REQUEST_TIMEOUT = httpx.Timeout(300.0, connect=10.0)

FORK_RESULTS = TypeAdapter(list[ForkResult])
HEALTH = TypeAdapter(Health)
SANDBOX = TypeAdapter(SandboxBody)
SANDBOX_DETAIL = TypeAdapter(SandboxDetail)
SANDBOX_DETAILS = TypeAdapter(list[SandboxDetail])
SNAPSHOT = TypeAdapter(SnapshotInfo)
SNAPSHOTS = TypeAdapter(list[SnapshotInfo])
TEMPLATES = TypeAdapter(list[TemplateInfo])

ModelT = TypeVar("ModelT")
ItemT = TypeVar("ItemT")
ItemT_co = TypeVar("ItemT_co", covariant=True)


class Paged(Protocol[ItemT_co]):
    """A page of a listing: its items and the token of the next page (None: the last)."""

    @property
    def items(self) -> Sequence[ItemT_co]: ...

    @property
    def next_token(self) -> str | None: ...


def walk_pages(fetch: Callable[[str | None], Paged[ItemT]]) -> Iterator[ItemT]:
    """Every item of a listing, fetching each page (``fetch(next_token)``) as it goes."""
    token: str | None = None
    while True:
        page = fetch(token)
        yield from page.items
        if page.next_token is None:
            return
        token = page.next_token


async def walk_pages_async(
    fetch: Callable[[str | None], Awaitable[Paged[ItemT]]],
) -> AsyncIterator[ItemT]:
    """:func:`walk_pages` for the async client."""
    token: str | None = None
    while True:
        page = await fetch(token)
        for item in page.items:
            yield item
        if page.next_token is None:
            return
        token = page.next_token


@dataclass(frozen=True)
class SnapshotPage:
    """One page of ``GET /snapshots``; ``next_token`` fetches the next, ``None`` at the end."""

    items: list[SnapshotInfo]
    next_token: str | None


@dataclass(frozen=True)
class SandboxPage:
    """One page of ``GET /v2/sandboxes``; ``next_token`` fetches the next, ``None`` at the
    end."""

    items: list[SandboxDetail]
    next_token: str | None


@dataclass(frozen=True)
class ResumeResult:
    """The answer to a connect: the sandbox as a create returns it, and whether it was
    paused and has been resumed (``False``: it was running already)."""

    sandbox: SandboxBody
    resumed: bool


def path_part(value: str) -> str:
    """``value`` as one URL path segment: ids are safe as they are, but names may hold
    ``/`` or ``:``, and an id from user input anything."""
    return urllib.parse.quote(value, safe="")


def snapshot_id_of(snapshot: str | SnapshotInfo) -> str:
    return snapshot if isinstance(snapshot, str) else snapshot.snapshot_id


def fork_body(count: int, timeout: int | None) -> dict[str, int]:
    if not 1 <= count <= MAX_FORK_CHILDREN:
        raise ValueError(f"count must be between 1 and {MAX_FORK_CHILDREN}, not {count}")
    body = {"count": count}
    if timeout is not None:
        body["timeout"] = timeout
    return body


def create_body(
    template: str,
    timeout: int | None,
    metadata: Mapping[str, str] | None,
    envs: Mapping[str, str] | None,
) -> dict[str, object]:
    body: dict[str, object] = {
        "templateID": template,
        "metadata": dict(metadata or {}),
        "envVars": dict(envs or {}),
    }
    if timeout is not None:
        body["timeout"] = timeout
    return body


def refresh_body(seconds: int) -> dict[str, int]:
    if not 0 <= seconds <= MAX_REFRESH_DURATION_S:
        raise ValueError(
            f"a refresh extends by 0 to {MAX_REFRESH_DURATION_S} seconds, not {seconds}"
        )
    return {"duration": seconds}


def network_update_body(
    allow_out: Sequence[str] | None,
    deny_out: Sequence[str] | None,
    dns_servers: Sequence[str] | None,
    allow_internet_access: bool | None,
) -> dict[str, object]:
    """Body of ``PUT /sandboxes/{id}/network``, spelt as e2b's SDK spells it. The server
    replaces the egress rules whole: what is left out here is cleared there."""
    body: dict[str, object] = {}
    if allow_out is not None:
        body["allowOut"] = list(allow_out)
    if deny_out is not None:
        body["denyOut"] = list(deny_out)
    if dns_servers is not None:
        body["dnsServers"] = list(dns_servers)
    if allow_internet_access is not None:
        body["allow_internet_access"] = allow_internet_access
    return body


def sandbox_query(
    state: str | None,
    metadata: Mapping[str, str] | None,
    limit: int | None,
    next_token: str | None,
    order: str | None = None,
) -> dict[str, str | int]:
    query: dict[str, str | int] = {}
    if order is not None:
        query["order"] = order
    if state is not None:
        query["state"] = state
    if metadata:
        # Quoted, then encoded once more (as the SDK does): the server unquotes each key
        # and value after parsing the query string, so `=` and `&` in them survive.
        query["metadata"] = urllib.parse.urlencode(
            {urllib.parse.quote(k): urllib.parse.quote(v) for k, v in metadata.items()}
        )
    if limit is not None:
        query["limit"] = limit
    if next_token is not None:
        query["nextToken"] = next_token
    return query


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
            f"unexpected response from {response.request.url} (is it an agentenv server?): "
            f"{exc.error_count()} problem(s), first: {exc.errors()[0]['msg']}",
        ) from exc


def next_token_of(response: httpx.Response) -> str | None:
    return response.headers.get("X-Next-Token") or None


def snapshot_page(response: httpx.Response) -> SnapshotPage:
    return SnapshotPage(items=decode(SNAPSHOTS, response), next_token=next_token_of(response))


def sandbox_page(response: httpx.Response) -> SandboxPage:
    return SandboxPage(items=decode(SANDBOX_DETAILS, response), next_token=next_token_of(response))


def resume_result(response: httpx.Response) -> ResumeResult:
    # The connect route answers 201 when it resumed the sandbox, 200 when it ran already.
    return ResumeResult(sandbox=decode(SANDBOX, response), resumed=response.status_code == 201)


def fork_children(
    results: list[ForkResult], connection: Connection, cls: type[SandboxT]
) -> list[SandboxT | AgentEnvError]:
    """One SDK sandbox per started child, in order, and an ``AgentEnvError`` in the place
    of each child that did not start."""
    children: list[SandboxT | AgentEnvError] = []
    for result in results:
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


def require_key(connection: Connection, what: str) -> None:
    """:class:`AuthError` before anything is sent when ``connection`` has no API key."""
    if not connection.api_key:
        raise AuthError(None, f"{what} needs an API key (AENV_API_KEY or E2B_API_KEY)")
