"""Issue #12's bad inputs, one test each, through the real application on the fakes of
:mod:`tests.fakes` (no root, no VMs): every one is refused with a JSON error before any
work is done (no VMM started, nothing written), and the OpenAPI document lists what the
API answers and the limits it checks."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from agentenv.api.app import create_app
from agentenv.limits import (
    MAX_EGRESS_ENTRIES,
    MAX_ENV_VAR_VALUE_LENGTH,
    MAX_METADATA_VALUE_LENGTH,
    MAX_REQUEST_BODY_BYTES,
    MAX_TEMPLATE_REF_LENGTH,
)
from agentenv.orchestrator import builds as builds_module
from agentenv.orchestrator.builds import BuildManager
from tests.fakes import FAKE_TEMPLATE, Node, in_process_client, start_node

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="disk overlays need qemu-img (qemu-utils)"
)

API_KEY = "e2b_" + "ef" * 20


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    started = await start_node(tmp_path / "a", tmp_path / "repository")
    yield started
    await started.stop()


@pytest.fixture
def app(node: Node) -> FastAPI:
    return create_app(node.orchestrator, API_KEY, manage_lifecycle=False)


@pytest.fixture
async def api(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with in_process_client(app, API_KEY) as client:
        yield client


class NoWork:
    """What a refused request must not have done: start (or kill) a VMM, or leave a
    sandbox record or directory."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.calls = list(node.driver.calls)
        self.killed = list(node.driver.killed)
        self.records = self._records()
        self.dirs = self._dirs()

    def _records(self) -> list[str]:
        return sorted(r.sandbox_id for r in self.node.orchestrator.store.list_sandboxes())

    def _dirs(self) -> list[str]:
        root = self.node.config.sandboxes_dir
        return sorted(p.name for p in root.iterdir()) if root.exists() else []

    def check(self) -> None:
        assert self.node.driver.calls == self.calls, "a VMM was started"
        assert self.node.driver.killed == self.killed, "a VMM was killed"
        assert self._records() == self.records
        assert self._dirs() == self.dirs


@pytest.fixture
def no_work(node: Node) -> Iterator[NoWork]:
    watch = NoWork(node)
    yield watch
    watch.check()


def error_of(response: httpx.Response, status: int) -> str:
    """The message of a JSON error ``{code, message}`` answered with ``status``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["code"] == status and isinstance(body["message"], str) and body["message"]
    message: str = body["message"]
    return message


async def _create(api: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    created = await api.post("/v2/sandboxes", json={"templateID": FAKE_TEMPLATE, **body})
    assert created.status_code == 201, created.text
    result: dict[str, Any] = created.json()
    return result


# -- template ids and names ----------------------------------------------------------------
async def test_template_id_longer_than_the_repository_holds_is_a_400(
    api: httpx.AsyncClient, no_work: NoWork
) -> None:
    long = "t" * (MAX_TEMPLATE_REF_LENGTH + 1)
    message = error_of(await api.post("/v2/sandboxes", json={"templateID": long}), 400)
    assert "templateID" in message and str(MAX_TEMPLATE_REF_LENGTH) in message
    # The longest the API accepts is one the repository can look up: unknown, not a 500.
    longest = "t" * MAX_TEMPLATE_REF_LENGTH
    message = error_of(await api.post("/v2/sandboxes", json={"templateID": longest}), 400)
    assert "not found" in message


@pytest.mark.parametrize("template_id", ["/x", "/", "a\x00b", "a\x1b[2Jb"])
async def test_template_id_with_a_leading_slash_or_control_character_is_a_400(
    api: httpx.AsyncClient, no_work: NoWork, template_id: str
) -> None:
    message = error_of(await api.post("/v2/sandboxes", json={"templateID": template_id}), 400)
    assert "templateID" in message


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/snapshots/%C3%A9"),
        ("DELETE", "/snapshots/%C3%A9"),
        ("GET", "/templates/aliases/%C3%A9"),
        ("DELETE", "/templates/%C3%A9"),
        ("GET", "/templates/%C3%A9"),
    ],
)
async def test_non_ascii_names_are_unknown_not_a_500(
    api: httpx.AsyncClient, no_work: NoWork, method: str, path: str
) -> None:
    assert "é" in error_of(await api.request(method, path), 404)


async def test_create_from_a_non_ascii_name_is_an_unknown_template(
    api: httpx.AsyncClient, no_work: NoWork
) -> None:
    message = error_of(await api.post("/v2/sandboxes", json={"templateID": "é"}), 400)
    assert "not found" in message


@pytest.mark.parametrize(
    ("method", "path", "parameter"),
    [
        ("GET", "/sandboxes/%C3%A9", "sandbox_id"),
        ("DELETE", "/sandboxes/a%00b", "sandbox_id"),
        ("POST", "/sandboxes/" + "i" * 129 + "/pause", "sandbox_id"),
        ("GET", "/snapshots/%2Fx", "snapshot_id"),
        ("DELETE", "/snapshots/a%00b", "snapshot_id"),
        ("DELETE", "/templates/" + "t" * (MAX_TEMPLATE_REF_LENGTH + 1), "template_id"),
        # A newline: the route must still match (Schemathesis once got a 405 here).
        ("DELETE", "/templates/%0AS%F3%92%96%9D%C2%99", "template_id"),
        ("GET", "/snapshots/a%0Ab", "snapshot_id"),
        ("GET", "/templates/aliases/" + "t" * (MAX_TEMPLATE_REF_LENGTH + 1), "alias"),
        ("GET", "/templates/x%20y/files/abc", "template_id"),
        ("GET", "/templates/t1/files/not-hex", "files_hash"),
        ("GET", "/templates/t1/builds/b%C3%A9/status", "build_id"),
    ],
)
async def test_path_parameters_out_of_their_limits_are_a_400(
    api: httpx.AsyncClient, no_work: NoWork, method: str, path: str, parameter: str
) -> None:
    assert parameter in error_of(await api.request(method, path), 400)


# -- env vars and metadata -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("env_vars", "says"),
    [
        ({"A=B": "x"}, "not a variable name"),
        ({"": "x"}, "not a variable name"),
        ({"A": "x" * (MAX_ENV_VAR_VALUE_LENGTH + 1)}, "at most"),
    ],
)
async def test_bad_env_vars_are_a_400_and_start_no_vm(
    api: httpx.AsyncClient, no_work: NoWork, env_vars: dict[str, str], says: str
) -> None:
    body = {"templateID": FAKE_TEMPLATE, "envVars": env_vars}
    message = error_of(await api.post("/v2/sandboxes", json=body), 400)
    assert "envVars" in message and says in message


async def test_env_var_value_over_a_mib_is_refused_unread(
    api: httpx.AsyncClient, no_work: NoWork
) -> None:
    body = {"templateID": FAKE_TEMPLATE, "envVars": {"A": "x" * (1 << 20 | 1)}}
    message = error_of(await api.post("/v2/sandboxes", json=body), 413)
    assert str(MAX_REQUEST_BODY_BYTES) in message


async def test_metadata_of_10_mib_is_refused(api: httpx.AsyncClient, no_work: NoWork) -> None:
    big = {"templateID": FAKE_TEMPLATE, "metadata": {"k": "v" * (10 << 20)}}
    error_of(await api.post("/v2/sandboxes", json=big), 413)
    # Within the body bound, the metadata's own limits refuse it.
    over = {"templateID": FAKE_TEMPLATE, "metadata": {"k": "v" * (MAX_METADATA_VALUE_LENGTH + 1)}}
    assert "metadata" in error_of(await api.post("/v2/sandboxes", json=over), 400)


async def test_a_chunked_body_is_bound_as_it_is_read(
    api: httpx.AsyncClient, no_work: NoWork
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"templateID": "fake", "metadata": {"k": "'
        for _ in range(40):
            yield b"v" * 65536
        yield b'"}}'

    response = await api.post(
        "/v2/sandboxes", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert "content-length" not in response.request.headers
    error_of(response, 413)


@pytest.mark.parametrize(
    ("network", "field"),
    [
        (
            {"allowOut": [f"10.0.{i // 256}.{i % 256}" for i in range(MAX_EGRESS_ENTRIES + 1)]},
            "allowOut",
        ),
        ({"denyOut": ["a" * 300 + ".example"]}, "denyOut"),
        ({"dnsServers": [f"10.0.0.{i}" for i in range(1, 11)]}, "dnsServers"),
        ({"maskRequestHost": "h" * 300}, "maskRequestHost"),
    ],
)
async def test_network_options_out_of_limits_are_a_400(
    api: httpx.AsyncClient, node: Node, network: dict[str, Any], field: str
) -> None:
    watch = NoWork(node)
    body = {"templateID": FAKE_TEMPLATE, "network": network}
    assert field in error_of(await api.post("/v2/sandboxes", json=body), 400)
    watch.check()
    if field != "maskRequestHost":
        sandbox_id = (await _create(api))["sandboxID"]
        put = await api.put(f"/sandboxes/{sandbox_id}/network", json=network)
        assert field in error_of(put, 400)


# -- upload tokens ---------------------------------------------------------------------------
@pytest.mark.parametrize("token", ["%C3%A9", "bad", "", "0" * 64])
async def test_bad_upload_tokens_are_a_json_403(
    api: httpx.AsyncClient, tmp_path: Path, token: str
) -> None:
    registered = await api.post("/v3/templates", json={"name": "uploads"})
    assert registered.status_code == 202, registered.text
    template_id = registered.json()["templateID"]
    files_hash = "ab" * 32
    put = await api.put(
        f"/templates/{template_id}/files/{files_hash}/upload?token={token}",
        content=b"archive",
        headers={"X-API-Key": ""},
    )
    assert "upload token" in error_of(put, 403)
    # The link's own token is taken.
    link = (await api.get(f"/templates/{template_id}/files/{files_hash}")).json()
    assert (await api.put(link["url"], content=b"archive")).status_code == 200


# -- timeouts --------------------------------------------------------------------------------
async def test_timeout_zero_is_a_400_not_an_instant_kill(
    api: httpx.AsyncClient, node: Node
) -> None:
    watch = NoWork(node)
    body = {"templateID": FAKE_TEMPLATE, "timeout": 0}
    assert "timeout" in error_of(await api.post("/v2/sandboxes", json=body), 400)
    assert "timeout" in error_of(await api.post("/sandboxes", json=body), 400)
    watch.check()
    sandbox_id = (await _create(api, timeout=60))["sandboxID"]
    end = (await api.get(f"/sandboxes/{sandbox_id}")).json()["endAt"]
    for path, request in [
        (f"/sandboxes/{sandbox_id}/timeout", {"timeout": 0}),
        (f"/v2/sandboxes/{sandbox_id}/connect", {"timeout": 0}),
        (f"/sandboxes/{sandbox_id}/resume", {"timeout": 0}),
        (f"/sandboxes/{sandbox_id}/fork", {"count": 1, "timeout": 0}),
    ]:
        assert "timeout" in error_of(await api.post(path, json=request), 400), path
    detail = await api.get(f"/sandboxes/{sandbox_id}")
    assert detail.status_code == 200 and detail.json()["state"] == "running"
    assert detail.json()["endAt"] == end


# -- paging ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "token", ["garbage", "2026-01-01T00:00:00|", "|ia", "2026-01-01T00:00:00|é", "x" * 300]
)
async def test_garbage_next_token_is_a_400(api: httpx.AsyncClient, token: str) -> None:
    for path in ("/v2/sandboxes", "/snapshots"):
        response = await api.get(path, params={"nextToken": token, "limit": 1})
        assert "nextToken" in error_of(response, 400), path


async def test_next_token_of_the_server_pages_on(api: httpx.AsyncClient) -> None:
    first = (await _create(api))["sandboxID"]
    second = (await _create(api))["sandboxID"]
    page = await api.get("/v2/sandboxes", params={"limit": 1})
    assert [s["sandboxID"] for s in page.json()] == [second]  # newest first, as E2B
    token = page.headers["X-Next-Token"]
    rest = await api.get("/v2/sandboxes", params={"limit": 1, "nextToken": token})
    assert [s["sandboxID"] for s in rest.json()] == [first]
    assert "X-Next-Token" not in rest.headers
    # URL-safe as it is: pasted into a URL unencoded, it is the same token.
    pasted = await api.get(f"/v2/sandboxes?limit=1&nextToken={token}")
    assert [s["sandboxID"] for s in pasted.json()] == [first]


# -- template names --------------------------------------------------------------------------
async def test_template_name_being_built_is_a_409(api: httpx.AsyncClient, app: FastAPI) -> None:
    first = await api.post("/v3/templates", json={"name": "twice"})
    assert first.status_code == 202, first.text
    again = await api.post("/v3/templates", json={"name": "twice"})
    assert first.json()["buildID"] in error_of(again, 409)
    assert "twice" in error_of(await api.post("/v3/templates", json={"alias": "twice"}), 409)
    # As in E2B, a finished build's name can be built again (a rebuild of the template).
    builds: BuildManager = app.state.builds
    builds.get(first.json()["templateID"]).status = "error"
    rebuilt = await api.post("/v3/templates", json={"name": "twice"})
    assert rebuilt.status_code == 202, rebuilt.text
    assert rebuilt.json()["buildID"] != first.json()["buildID"]


async def test_registered_build_never_started_releases_its_name(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (await api.post("/v3/templates", json={"name": "abandoned"})).status_code == 202
    error_of(await api.post("/v3/templates", json={"name": "abandoned"}), 409)
    monkeypatch.setattr(builds_module, "UNSTARTED_BUILD_HOLD", timedelta(0))
    assert (await api.post("/v3/templates", json={"name": "abandoned"})).status_code == 202


async def test_template_name_of_a_snapshot_or_base_is_a_409(api: httpx.AsyncClient) -> None:
    sandbox_id = (await _create(api))["sandboxID"]
    snap = await api.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "taken"})
    assert snap.status_code == 201, snap.text
    assert "snapshot" in error_of(await api.post("/v3/templates", json={"name": "taken"}), 409)
    error_of(await api.post("/v3/templates", json={"name": "base"}), 409)


@pytest.mark.parametrize(
    "body",
    [
        {"name": "a b"},
        {"name": "/lead"},
        {"name": "n" * 129},
        {"name": "x\x00"},
        {"name": "ok", "cpuCount": 0},
        {"name": "ok", "memoryMB": 64},
    ],
)
async def test_template_build_request_out_of_limits_is_a_400(
    api: httpx.AsyncClient, body: dict[str, Any]
) -> None:
    error_of(await api.post("/v3/templates", json=body), 400)


# -- every error is JSON, and documented -------------------------------------------------------
async def test_errors_outside_the_routes_are_json(api: httpx.AsyncClient) -> None:
    assert error_of(await api.get("/no/such/route"), 404)
    assert error_of(await api.patch("/sandboxes"), 405)
    assert error_of(await api.get("/sandboxes", headers={"X-API-Key": "wrong"}), 401)
    too_big = await api.post(
        "/v2/sandboxes",
        content=b"{}",
        headers={"Content-Type": "application/json", "Content-Length": str(10 << 20)},
    )
    error_of(too_big, 413)
    headers = {f"X-Filler-{i}": "f" * 1000 for i in range(80)}
    error_of(await api.get("/sandboxes", headers=headers), 431)
    malformed = await api.post(
        "/v2/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    error_of(malformed, 400)


async def test_openapi_lists_every_status_and_the_limits(api: httpx.AsyncClient) -> None:
    doc = (await api.get("/openapi.json")).json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            statuses = set(operation["responses"])
            assert "422" not in statuses, (method, path)
            documented = {"400", "404", "413", "431", "500", "502", "503", "507"}
            assert documented <= statuses, (method, path)
    upload = doc["paths"]["/templates/{template_id}/files/{files_hash}/upload"]["put"]
    assert "403" in upload["responses"]
    new = doc["components"]["schemas"]["NewSandbox"]["properties"]
    assert new["templateID"]["maxLength"] == MAX_TEMPLATE_REF_LENGTH
    assert new["templateID"]["pattern"]
    assert new["timeout"]["anyOf"][0]["minimum"] == 1
    assert "64 entries" in new["metadata"]["description"]
    assert "256 variables" in new["envVars"]["description"]
    get = doc["paths"]["/sandboxes/{sandbox_id}"]["get"]
    sandbox_id = next(p for p in get["parameters"] if p["name"] == "sandbox_id")
    assert sandbox_id["schema"]["maxLength"] == 128 and sandbox_id["schema"]["pattern"]
    listing = doc["paths"]["/v2/sandboxes"]["get"]
    token = next(p for p in listing["parameters"] if p["name"] == "nextToken")
    assert token["schema"]["anyOf"][0]["maxLength"] == 256


async def test_openapi_links_a_create_to_the_routes_of_its_sandbox(api: httpx.AsyncClient) -> None:
    doc = (await api.get("/openapi.json")).json()
    links = doc["paths"]["/sandboxes"]["post"]["responses"]["201"]["links"]
    operation_ids = {
        operation["operationId"]: (method, path)
        for path, item in doc["paths"].items()
        for method, operation in item.items()
    }
    linked = {operation_ids[link["operationId"]] for link in links.values()}
    assert {
        ("get", "/sandboxes/{sandbox_id}"),
        ("delete", "/sandboxes/{sandbox_id}"),
        ("post", "/sandboxes/{sandbox_id}/pause"),
        ("post", "/sandboxes/{sandbox_id}/connect"),
        ("post", "/sandboxes/{sandbox_id}/fork"),
    } <= linked
    assert all(path.count("{") == 1 for _, path in linked)
    for link in links.values():
        assert link["parameters"] == {"sandbox_id": "$response.body#/sandboxID"}
