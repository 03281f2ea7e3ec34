"""Template tags (issue #18) and start-command readiness, without VMs: the parsing and
checking of names and tags, the readiness decision on fake guests, and the tag routes
through the real application on the fakes of :mod:`tests.fakes`, with template builds
stood in for by template snapshots of a fake sandbox committed to a shared repository,
so that a second node sees the same tags."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.api.app import create_app
from agentenv.orchestrator.errors import InvalidRequest
from agentenv.orchestrator.readiness import (
    NotReady,
    StartCommandFailed,
    StartState,
    wait_until_ready,
)
from agentenv.orchestrator.records import SnapshotEntry
from agentenv.orchestrator.tags import (
    family_of,
    normalize_tag,
    normalize_tags,
    parse_tagged,
    split_name,
)
from tests.fakes import FAKE_TEMPLATE, Node, in_process_client, start_node

API_KEY = "e2b_" + "ab" * 20

needs_qemu_img = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="disk overlays need qemu-img (qemu-utils)"
)


# -- names and tags ----------------------------------------------------------------------------
def test_tags_are_trimmed_lower_cased_and_checked() -> None:
    assert normalize_tag(" V1.0_rc-2 ") == "v1.0_rc-2"
    for bad in ["", "a b", "a/b", "a:b", "é", "t" * 129, ".", str(uuid.uuid4())]:
        with pytest.raises(InvalidRequest):
            normalize_tag(bad)
    assert normalize_tags(["Stable", "v1", "stable"]) == ["stable", "v1"]


def test_names_split_at_the_first_colon() -> None:
    assert split_name("web") == ("web", None)
    assert split_name("web:V2") == ("web", "v2")
    assert split_name("team/web:default") == ("team/web", "default")
    for bad in ["web:", ":v1", "web:a:b"]:
        with pytest.raises(InvalidRequest):
            split_name(bad)


def test_references_with_a_tag_or_a_build_id() -> None:
    build = str(uuid.uuid4())
    assert parse_tagged("web:v2") == ("web", "v2", None)
    assert parse_tagged(f"web:{build.upper()}") == ("web", "", build)
    # Not a tagged reference: only an id or a plain name (a snapshot's may hold ":").
    assert parse_tagged("web") is None
    assert parse_tagged("web:") is None
    assert parse_tagged("snap:with space") is None


def test_a_build_belongs_to_its_template_name() -> None:
    def entry(**fields: Any) -> SnapshotEntry:
        base: dict[str, Any] = {
            "id": "x",
            "created_at": "2026-01-01T00:00:00Z",
            "vcpus": 1,
            "memory_mib": 128,
            "disk_size_mib": 1,
            "envd_version": "0.1",
            "manifest": {},
            "blobs": {},
        }
        return SnapshotEntry.from_wire({**base, **fields})

    assert family_of(entry(type="template", metadata={"templateName": "web"})) == "web"
    # Records from before tags: the name they were committed under.
    assert family_of(entry(type="template", names=["old"])) == "old"
    assert family_of(entry(type="snapshot", names=["snap"])) is None


# -- readiness ---------------------------------------------------------------------------------
class Guest:
    """A start command and a ready command whose answers are scripted per poll."""

    def __init__(self, states: list[StartState], ready: list[bool]) -> None:
        self.states = states
        self.ready_answers = ready
        self.now = 0.0
        self.polls = 0

    async def state(self) -> StartState:
        return self.states[min(self.polls, len(self.states) - 1)]

    async def ready(self) -> bool:
        answer = self.ready_answers[min(self.polls, len(self.ready_answers) - 1)]
        self.polls += 1
        return answer

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


async def wait(
    guest: Guest, start: Callable[[], Awaitable[StartState]] | None, timeout_s: float = 10
) -> None:
    await wait_until_ready(
        start, guest.ready, timeout_s=timeout_s, poll_s=1, clock=guest.clock, sleep=guest.sleep
    )


async def test_a_start_command_that_exits_0_leaves_readiness_to_the_ready_command() -> None:
    ended = StartState(running=False, exit_code=0)
    guest = Guest([ended], [False, False, True])
    await wait(guest, guest.state)
    assert guest.polls == 3


async def test_a_start_command_that_fails_first_fails_the_build() -> None:
    guest = Guest([StartState(running=True), StartState(running=False, exit_code=3)], [False])
    with pytest.raises(StartCommandFailed, match="exited with code 3"):
        await wait(guest, guest.state)
    # Killed, its status never written.
    guest = Guest([StartState(running=False)], [True])
    with pytest.raises(StartCommandFailed, match="without an exit status"):
        await wait(guest, guest.state)


async def test_a_start_command_failing_while_the_ready_command_ran_fails_the_build() -> None:
    guest = Guest([StartState(running=True), StartState(running=False, exit_code=1)], [True])
    with pytest.raises(StartCommandFailed):
        await wait(guest, guest.state)


async def test_a_ready_command_that_never_succeeds_times_out() -> None:
    guest = Guest([StartState(running=False, exit_code=0)], [False])
    with pytest.raises(NotReady, match=r"within 10s \(the start command exited with code 0\)"):
        await wait(guest, guest.state, timeout_s=10)
    assert guest.now >= 10


async def test_a_ready_command_alone_is_waited_for() -> None:
    guest = Guest([], [False, True])
    await wait(guest, None)
    assert guest.polls == 2


async def test_a_running_start_command_with_a_passing_ready_command_is_ready() -> None:
    guest = Guest([StartState(running=True)], [True])
    await wait(guest, guest.state)


# -- the tag routes ----------------------------------------------------------------------------
@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[tuple[Node, Node]]:
    a = await start_node(tmp_path / "a", tmp_path / "repository")
    b = await start_node(tmp_path / "b", tmp_path / "repository", node_id="node-b")
    yield a, b
    await b.stop()
    await a.stop()


@pytest.fixture
async def api(nodes: tuple[Node, Node]) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(nodes[0].orchestrator, API_KEY, manage_lifecycle=False)
    async with in_process_client(app, API_KEY) as client:
        yield client


@pytest.fixture
async def other_api(nodes: tuple[Node, Node]) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(nodes[1].orchestrator, API_KEY, manage_lifecycle=False)
    async with in_process_client(app, API_KEY) as client:
        yield client


async def build(node: Node, name: str, tags: list[str]) -> str:
    """What a finished build of template ``name`` tagged ``tags`` leaves in the
    repository (a template snapshot of a fake sandbox, as builds.py commits it)."""
    orchestrator = node.orchestrator
    view = await orchestrator.create(FAKE_TEMPLATE, timeout=60)
    build_id = str(uuid.uuid4())
    try:
        await orchestrator.snapshot(
            view.sandbox_id,
            name if "default" in tags else None,
            kind="template",
            replace_name=True,
            wait_commit=True,
            snapshot_id=build_id,
            metadata={"buildID": build_id, "templateID": build_id, "templateName": name},
        )
        others = [t for t in tags if t != "default"]
        if others:
            await orchestrator.tag_build(name, others, build_id)
    finally:
        await orchestrator.kill(view.sandbox_id)
    return build_id


async def started_from(api: httpx.AsyncClient, template: str) -> str:
    created = await api.post("/v2/sandboxes", json={"templateID": template, "timeout": 60})
    assert created.status_code == 201, created.text
    await api.delete(f"/sandboxes/{created.json()['sandboxID']}")
    template_id: str = created.json()["templateID"]
    return template_id


def status_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    message: str = response.json()["message"]
    return message


def tags_of(response: httpx.Response) -> dict[str, str]:
    assert response.status_code == 200, response.text
    return {t["tag"]: t["buildID"] for t in response.json()}


@needs_qemu_img
async def test_tags_start_their_builds_on_every_node(
    nodes: tuple[Node, Node], api: httpx.AsyncClient, other_api: httpx.AsyncClient
) -> None:
    first = await build(nodes[0], "web", ["default"])
    second = await build(nodes[0], "web", ["v2", "canary"])
    # "web" is "web:default", still the first build; v2 and canary the second.
    assert await started_from(api, "web") == first
    assert await started_from(api, "web:default") == first
    assert await started_from(api, "web:v2") == second
    assert await started_from(api, f"web:{second}") == second
    # Another node sharing the repository sees the same tags.
    assert await started_from(other_api, "web:canary") == second
    expected = {"default": first, "v2": second, "canary": second}
    assert tags_of(await other_api.get("/templates/web/tags")) == expected
    # By a build's id too, as the SDK's get_tags(build_info.template_id) asks.
    assert tags_of(await api.get(f"/templates/{second}/tags")) == expected
    alias = await api.get("/templates/aliases/web:v2")
    assert alias.json()["templateID"] == second
    assert (await api.get("/templates/web:v2")).json()["templateID"] == second
    # A rebuild without tags takes the name: "web" is that build now, not an older one.
    third = await build(nodes[0], "web", ["default"])
    assert (await other_api.get("/templates/web")).json()["templateID"] == third
    assert await started_from(other_api, "web") == third

    # An unknown tag of a known template is a 404 (as E2B answers); an unknown
    # template stays a create's 400.
    assert "nope" in status_of(
        await api.post("/v2/sandboxes", json={"templateID": "web:nope"}), 404
    )
    status_of(await api.post("/v2/sandboxes", json={"templateID": "other:v1"}), 400)


@needs_qemu_img
async def test_assign_and_remove_tags(
    nodes: tuple[Node, Node], api: httpx.AsyncClient, other_api: httpx.AsyncClient
) -> None:
    first = await build(nodes[0], "app", ["default"])
    second = await build(nodes[0], "app", ["v2"])
    assigned = await api.post(
        "/templates/tags", json={"target": "app:v2", "tags": ["Stable", "stable", "prod"]}
    )
    assert assigned.status_code == 201, assigned.text
    assert assigned.json() == {"tags": ["stable", "prod"], "buildID": second}
    assert await started_from(other_api, "app:stable") == second
    # The default tag moves like any other: "app" now starts the second build.
    moved = await api.post("/templates/tags", json={"target": "app:v2", "tags": ["default"]})
    assert moved.status_code == 201, moved.text
    assert await started_from(api, "app") == second
    back = await api.post("/templates/tags", json={"target": f"app:{first}", "tags": ["default"]})
    assert back.status_code == 201 and back.json()["buildID"] == first

    removed = await api.request("DELETE", "/templates/tags", json={"name": "app", "tags": ["prod"]})
    assert removed.status_code == 204, removed.text
    assert set(tags_of(await other_api.get("/templates/app/tags"))) == {"default", "v2", "stable"}
    status_of(await api.post("/v2/sandboxes", json={"templateID": "app:prod"}), 404)
    # Unknown tags are a 404, and nothing is removed.
    missing = await api.request(
        "DELETE", "/templates/tags", json={"name": "app", "tags": ["stable", "prod"]}
    )
    assert "prod" in status_of(missing, 404)
    assert "stable" in tags_of(await api.get("/templates/app/tags"))


@needs_qemu_img
@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/templates/tags", {"target": "app:nope", "tags": ["x"]}, 404),
        ("POST", "/templates/tags", {"target": "ghost", "tags": ["x"]}, 404),
        ("POST", "/templates/tags", {"target": "app", "tags": []}, 400),
        ("POST", "/templates/tags", {"target": "app", "tags": ["a b"]}, 400),
        ("POST", "/templates/tags", {"target": "app", "tags": [str(uuid.UUID(int=7))]}, 400),
        ("POST", "/templates/tags", {"target": "app:", "tags": ["x"]}, 400),
        ("POST", "/templates/tags", {"target": "base", "tags": ["x"]}, 409),
        ("POST", "/templates/tags", {"tags": ["x"]}, 400),
        ("DELETE", "/templates/tags", {"name": "app", "tags": ["default"]}, 400),
        ("DELETE", "/templates/tags", {"name": "app:v1", "tags": ["v1"]}, 400),
        ("DELETE", "/templates/tags", {"name": "ghost", "tags": ["v1"]}, 404),
        ("DELETE", "/templates/tags", {"name": "app", "tags": ["v1/x"]}, 400),
        ("GET", "/templates/ghost/tags", None, 404),
        ("POST", "/v3/templates", {"name": "app:"}, 400),
        ("POST", "/v3/templates", {"name": "app", "tags": ["a/b"]}, 400),
    ],
)
async def test_bad_tag_requests_are_a_clear_4xx(
    nodes: tuple[Node, Node],
    api: httpx.AsyncClient,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    status: int,
) -> None:
    await build(nodes[0], "app", ["default"])
    response = await api.request(method, path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["code"] == status and response.json()["message"]


@needs_qemu_img
async def test_builds_are_registered_with_their_tags(api: httpx.AsyncClient) -> None:
    tagged = await api.post("/v3/templates", json={"name": "svc:V1", "tags": ["latest", "v1"]})
    assert tagged.status_code == 202, tagged.text
    assert tagged.json()["tags"] == ["v1", "latest"] and tagged.json()["names"] == ["svc"]
    plain = await api.post("/v3/templates", json={"name": "other"})
    assert plain.json()["tags"] == ["default"]


@needs_qemu_img
async def test_a_snapshot_name_and_a_tag_cannot_mean_the_same(
    nodes: tuple[Node, Node], api: httpx.AsyncClient
) -> None:
    await build(nodes[0], "app", ["default", "v1"])
    sandbox = (await api.post("/v2/sandboxes", json={"templateID": FAKE_TEMPLATE})).json()
    taken = await api.post(f"/sandboxes/{sandbox['sandboxID']}/snapshots", json={"name": "app:v1"})
    status_of(taken, 409)
    snap = await api.post(f"/sandboxes/{sandbox['sandboxID']}/snapshots", json={"name": "app:v9"})
    assert snap.status_code == 201, snap.text
    status_of(await api.post("/templates/tags", json={"target": "app", "tags": ["v9"]}), 409)
    status_of(await api.post("/v3/templates", json={"name": "app:v9"}), 409)


@needs_qemu_img
async def test_deleting_a_template_by_name_and_tag_deletes_all_of_it(
    nodes: tuple[Node, Node], api: httpx.AsyncClient, other_api: httpx.AsyncClient
) -> None:
    first = await build(nodes[0], "gone", ["default"])
    await build(nodes[0], "gone", ["v2"])
    kept = await build(nodes[0], "kept", ["default"])
    assert (await api.delete("/templates/gone:v2")).status_code == 204
    status_of(await other_api.post("/v2/sandboxes", json={"templateID": "gone"}), 400)
    status_of(await other_api.post("/v2/sandboxes", json={"templateID": f"gone:{first}"}), 400)
    status_of(await other_api.get("/templates/gone/tags"), 404)
    status_of(await other_api.get("/templates/aliases/gone:v2"), 404)
    assert await started_from(other_api, "kept") == kept
    # A build's id deletes that build only.
    only = await build(nodes[0], "kept", ["v2"])
    assert (await api.delete(f"/templates/{only}")).status_code == 204
    assert await started_from(api, "kept") == kept
    assert tags_of(await api.get("/templates/kept/tags")) == {"default": kept}


@needs_qemu_img
async def test_a_template_is_listed_once_whatever_its_builds(
    nodes: tuple[Node, Node], api: httpx.AsyncClient, other_api: httpx.AsyncClient
) -> None:
    first = await build(nodes[0], "listed", ["default"])
    second = await build(nodes[0], "listed", ["v2"])
    only_tagged = await build(nodes[0], "tagonly", ["v1"])

    def ours(listing: httpx.Response, name: str) -> list[dict[str, Any]]:
        assert listing.status_code == 200, listing.text
        return [t for t in listing.json() if name in t["names"]]

    for client in (api, other_api):
        for route in ("/v2/templates", "/templates"):
            (entry,) = ours(await client.get(route), "listed")
            # The name's entry is the build the name starts.
            assert entry["templateID"] == first and entry["buildID"] == first
            assert entry["buildCount"] == 2 and entry["aliases"] == ["listed"]
            (tagged,) = ours(await client.get(route), "tagonly")
            assert tagged["templateID"] == only_tagged and tagged["names"] == ["tagonly"]
    # Moving the default tag moves the entry; the look-up lists every build.
    moved = await api.post("/templates/tags", json={"target": "listed:v2", "tags": ["default"]})
    assert moved.status_code == 201, moved.text
    (entry,) = ours(await other_api.get("/v2/templates"), "listed")
    assert entry["templateID"] == second
    detail = (await api.get("/templates/listed")).json()
    assert detail["templateID"] == second
    assert {b["buildID"] for b in detail["builds"]} == {first, second}
    assert (await api.get(f"/templates/listed:{first}")).json()["templateID"] == first
    # Pages: limit and nextToken walk every template once.
    seen: list[str] = []
    token: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 1, **({"nextToken": token} if token else {})}
        got = await api.get("/v2/templates", params=params)
        assert got.status_code == 200, got.text
        seen += [t["templateID"] for t in got.json()]
        token = got.headers.get("x-next-token")
        if token is None:
            break
    everything = [t["templateID"] for t in (await api.get("/v2/templates")).json()]
    assert seen == everything and len(set(seen)) == len(seen)


@needs_qemu_img
async def test_tag_count_exists_groups_and_assignments(
    nodes: tuple[Node, Node], api: httpx.AsyncClient
) -> None:
    first = await build(nodes[0], "hist", ["default"])
    second = await build(nodes[0], "hist", ["v2", "canary"])
    count = await api.get("/templates/hist/tags/count")
    assert count.json() == {"total": 3}
    assert (await api.get(f"/templates/{second}/tags/count")).json() == {"total": 3}
    exists = await api.get("/templates/hist/tags/exists", params={"tag": " V2 "})
    assert exists.json() == {"exists": True, "normalizedTag": "v2"}
    missing = await api.get("/templates/hist/tags/exists", params={"tag": "nope"})
    assert missing.json() == {"exists": False, "normalizedTag": "nope"}
    status_of(await api.get("/templates/hist/tags/exists", params={"tag": "a b"}), 400)

    groups = await api.get("/templates/hist/tags/groups", params={"sort": "name_asc"})
    assert groups.status_code == 200, groups.text
    body = groups.json()
    assert [g["tag"] for g in body["tags"]] == ["canary", "default", "v2"]
    assert body["nextCursor"] is None
    by_tag = {g["tag"]: g["assignments"] for g in body["tags"]}
    assert by_tag["default"][0]["buildId"] == first
    assert by_tag["v2"][0]["buildId"] == second and not body["tags"][0]["hasMore"]
    # Pages of one tag, name descending, then a search.
    walked: list[str] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"sort": "name_desc", "tagsLimit": 1}
        if cursor:
            params["tagsCursor"] = cursor
        got = (await api.get("/templates/hist/tags/groups", params=params)).json()
        walked += [g["tag"] for g in got["tags"]]
        cursor = got["nextCursor"]
        if cursor is None:
            break
    assert walked == ["v2", "default", "canary"]
    searched = await api.get("/templates/hist/tags/groups", params={"search": "CAN"})
    assert [g["tag"] for g in searched.json()["tags"]] == ["canary"]
    bad = await api.get("/templates/hist/tags/groups", params={"tagsCursor": "x", "sort": "x"})
    assert bad.status_code == 400, bad.text

    assignments = await api.get("/templates/hist/tags/canary/assignments")
    assert assignments.status_code == 200, assignments.text
    (event,) = assignments.json()["data"]
    assert event["buildId"] == second and assignments.json()["nextCursor"] is None
    # An unknown tag, or template, is a 404 on every route.
    status_of(await api.get("/templates/hist/tags/nope/assignments"), 404)
    for route in ("tags", "tags/count", "tags/groups", "tags/v1/assignments"):
        status_of(await api.get(f"/templates/nowhere/{route}"), 404)
    status_of(await api.get("/templates/nowhere/tags/exists", params={"tag": "v1"}), 404)
