"""``GET /v2/sandboxes`` as E2B's (issue #18, item 2): ``order``, ``startedAfter``,
``template``, ``state``, ``metadata``, ``limit`` and ``nextToken``, through the real
application on the fakes of :mod:`tests.fakes` (no root, no VMs)."""

from __future__ import annotations

import base64
import shutil
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from agentenv.api.app import create_app
from agentenv.api.listing import DEFAULT_SANDBOX_PAGE_SIZE
from tests.fakes import FAKE_TEMPLATE, Node, in_process_client, start_node

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="disk overlays need qemu-img (qemu-utils)"
)

API_KEY = "e2b_" + "ab" * 20


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    started = await start_node(tmp_path / "a", tmp_path / "repository")
    yield started
    await started.stop()


@pytest.fixture
async def api(node: Node) -> AsyncIterator[httpx.AsyncClient]:
    app: FastAPI = create_app(node.orchestrator, API_KEY, manage_lifecycle=False)
    async with in_process_client(app, API_KEY) as client:
        yield client


async def create(api: httpx.AsyncClient, template: str = FAKE_TEMPLATE, **body: Any) -> str:
    created = await api.post("/v2/sandboxes", json={"templateID": template, **body})
    assert created.status_code == 201, created.text
    sandbox_id: str = created.json()["sandboxID"]
    return sandbox_id


async def listed(api: httpx.AsyncClient, **params: Any) -> list[str]:
    response = await api.get("/v2/sandboxes", params=params)
    assert response.status_code == 200, response.text
    return [s["sandboxID"] for s in response.json()]


async def walk(api: httpx.AsyncClient, **params: Any) -> list[str]:
    """Every page of a listing, following ``X-Next-Token``."""
    seen: list[str] = []
    token: str | None = None
    while True:
        query = dict(params, **({"nextToken": token} if token else {}))
        response = await api.get("/v2/sandboxes", params=query)
        assert response.status_code == 200, response.text
        seen += [s["sandboxID"] for s in response.json()]
        token = response.headers.get("X-Next-Token")
        if not token:
            return seen


def error_of(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["code"] == 400
    message: str = body["message"]
    return message


async def test_newest_first_by_default_and_order_asc_or_desc(api: httpx.AsyncClient) -> None:
    made = [await create(api) for _ in range(3)]
    assert await listed(api) == made[::-1]
    assert await listed(api, order="desc") == made[::-1]
    assert await listed(api, order="asc") == made
    # v1 lists newest first as well (E2B's GET /sandboxes).
    v1 = await api.get("/sandboxes")
    assert [s["sandboxID"] for s in v1.json()] == made[::-1]


async def test_order_applies_to_the_whole_listing_before_paging(api: httpx.AsyncClient) -> None:
    made = [await create(api) for _ in range(5)]
    for order, expected in (("asc", made), ("desc", made[::-1])):
        first = await api.get("/v2/sandboxes", params={"order": order, "limit": 2})
        assert [s["sandboxID"] for s in first.json()] == expected[:2]
        assert await walk(api, order=order, limit=2) == expected


async def test_bad_order_is_a_400_naming_it(api: httpx.AsyncClient) -> None:
    for bad in ("ASC", "newest", ""):
        assert "order" in error_of(await api.get("/v2/sandboxes", params={"order": bad}))


async def test_started_after_is_at_or_after(api: httpx.AsyncClient) -> None:
    made = [await create(api) for _ in range(3)]
    started = (await api.get(f"/sandboxes/{made[1]}")).json()["startedAt"]
    assert await listed(api, startedAfter=started, order="asc") == made[1:]
    # The SDK's form: astimezone().isoformat(), another offset for the same instant.
    when = datetime.fromisoformat(started).astimezone(timezone(timedelta(hours=5, minutes=30)))
    assert await listed(api, startedAfter=when.isoformat(), order="asc") == made[1:]
    later = datetime.fromisoformat(started) + timedelta(microseconds=1)
    assert await listed(api, startedAfter=later.isoformat(), order="asc") == made[2:]
    assert await listed(api, startedAfter="2000-01-01T00:00:00Z") == made[::-1]
    assert await listed(api, startedAfter="2999-01-01T00:00:00Z") == []


@pytest.mark.parametrize("bad", ["yesterday", "2026-13-01T00:00:00Z", "2026-01-01T00:00:00"])
async def test_bad_started_after_is_a_400_naming_it(api: httpx.AsyncClient, bad: str) -> None:
    # Without an offset the instant is unknown (E2B's spec: date-time, RFC 3339).
    response = await api.get("/v2/sandboxes", params={"startedAfter": bad})
    assert "startedAfter" in error_of(response)


async def test_template_by_id_or_name(api: httpx.AsyncClient) -> None:
    from_template = await create(api)
    snap = await api.post(f"/sandboxes/{from_template}/snapshots", json={"name": "listed-snap"})
    assert snap.status_code == 201, snap.text
    snapshot_id = snap.json()["snapshotID"]
    from_snapshot = await create(api, template="listed-snap")
    assert await listed(api, template=FAKE_TEMPLATE) == [from_template]
    assert await listed(api, template="listed-snap") == [from_snapshot]
    assert await listed(api, template=snapshot_id) == [from_snapshot]
    # A template that names nothing lists nothing, as in E2B.
    assert await listed(api, template="no-such-template") == []
    for bad in ("x" * 1000, "/leading-slash", "a\x1bb"):
        assert "template" in error_of(await api.get("/v2/sandboxes", params={"template": bad}))


async def test_state_and_metadata_filters(api: httpx.AsyncClient) -> None:
    kept = await create(api, metadata={"team": "a b/ü"})
    other = await create(api, metadata={"team": "b"})
    paused = await create(api, metadata={"team": "a b/ü"})
    assert (await api.post(f"/sandboxes/{paused}/pause")).status_code == 204
    assert await listed(api, state="running") == [other, kept]
    assert await listed(api, state="paused") == [paused]
    assert await listed(api, state="running,paused") == [paused, other, kept]
    # The SDK's encoding: keys and values quoted, the whole urlencoded once more.
    assert await listed(api, metadata="team=a%20b%2F%C3%BC", state="running") == [kept]
    assert "state" in error_of(await api.get("/v2/sandboxes", params={"state": "dead"}))


async def test_limit_defaults_to_e2bs_and_is_bounded(api: httpx.AsyncClient) -> None:
    made = [await create(api) for _ in range(3)]
    response = await api.get("/v2/sandboxes")
    assert len(response.json()) == 3 and "X-Next-Token" not in response.headers
    assert DEFAULT_SANDBOX_PAGE_SIZE == 100
    assert await walk(api, limit=1) == made[::-1]
    for bad in ("0", "1001", "many"):
        assert "limit" in error_of(await api.get("/v2/sandboxes", params={"limit": bad}))


async def test_paging_is_stable_under_creates_and_kills(api: httpx.AsyncClient) -> None:
    """A token is a position: sandboxes created between pages neither repeat an item
    nor shift one out; one killed is simply not served."""
    made = [await create(api) for _ in range(4)]
    for order in ("desc", "asc"):
        first = await api.get("/v2/sandboxes", params={"order": order, "limit": 2})
        seen = [s["sandboxID"] for s in first.json()]
        newcomer = await create(api)
        rest = await walk(api, order=order, limit=2)  # from the start: a reference
        token = first.headers["X-Next-Token"]
        second = await api.get(
            "/v2/sandboxes", params={"order": order, "limit": 2, "nextToken": token}
        )
        seen += [s["sandboxID"] for s in second.json()]
        while second.headers.get("X-Next-Token"):
            token = second.headers["X-Next-Token"]
            second = await api.get(
                "/v2/sandboxes", params={"order": order, "limit": 2, "nextToken": token}
            )
            seen += [s["sandboxID"] for s in second.json()]
        assert len(seen) == len(set(seen)), "an item was served twice"
        assert set(made) <= set(seen), "an item was shifted out of the listing"
        # Newest first: the newcomer sorts before the position, so it is not served;
        # oldest first it sorts after, and is.
        assert (newcomer in seen) == (order == "asc")
        assert set(rest) == set(made) | {newcomer}
        made.append(newcomer)
    # A kill between pages: the rest of the walk goes on from the position.
    first = await api.get("/v2/sandboxes", params={"order": "asc", "limit": 2})
    assert (await api.delete(f"/sandboxes/{first.json()[0]['sandboxID']}")).status_code == 204
    token = first.headers["X-Next-Token"]
    after = await api.get(
        "/v2/sandboxes", params={"order": "asc", "limit": 100, "nextToken": token}
    )
    assert [s["sandboxID"] for s in after.json()] == made[2:]


async def test_a_token_is_for_its_order_and_this_server(api: httpx.AsyncClient) -> None:
    for _ in range(3):
        await create(api)
    desc = await api.get("/v2/sandboxes", params={"limit": 1})
    token = desc.headers["X-Next-Token"]
    other_order = await api.get(
        "/v2/sandboxes", params={"order": "asc", "limit": 1, "nextToken": token}
    )
    assert "nextToken" in error_of(other_order)
    forged = base64.urlsafe_b64encode(b"desc|not a time|ia").decode()
    for bad in (forged, "2026-01-01T00:00:00+00:00|ia", "!!!"):
        response = await api.get("/v2/sandboxes", params={"limit": 1, "nextToken": bad})
        assert "nextToken" in error_of(response)


async def test_parameters_are_in_the_openapi_document(api: httpx.AsyncClient) -> None:
    document = (await api.get("/openapi.json")).json()
    params = {p["name"]: p for p in document["paths"]["/v2/sandboxes"]["get"]["parameters"]}
    assert {"order", "startedAfter", "template", "state", "metadata", "limit", "nextToken"} <= set(
        params
    )
    for name in ("order", "startedAfter", "template", "limit"):
        assert params[name].get("description"), name
    assert params["limit"]["schema"]["default"] == DEFAULT_SANDBOX_PAGE_SIZE
