"""``GET /nodes``, ``GET /nodes/{id}`` (E2B's Node and NodeDetail) and ``/metrics`` on
a node, against an orchestrator with fake VMs, and the node's description travelling in
its heartbeat to the gateway's ``/nodes``."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentenv import __version__
from agentenv.api.app import create_app
from agentenv.api.nodes import NodeBook
from agentenv.cluster.gateway import Gateway
from agentenv.cluster.heartbeat import node_report
from agentenv.cluster.placement import LeastLoaded
from agentenv.cluster.registry import NodeRegistry
from agentenv.cluster.scheduler import create_scheduler_app
from agentenv.cluster.scheduler_client import SchedulerClient
from agentenv.cluster.store import MemoryStore
from tests.fakes import FAKE_TEMPLATE, Node, in_process_client, start_node

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="disk overlays need qemu-img (qemu-utils)"
)

API_KEY = "e2b_" + "cd" * 20


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    started = await start_node(tmp_path / "a", tmp_path / "repository")
    yield started
    await started.stop()


@pytest.fixture
async def api(node: Node) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(node.orchestrator, API_KEY, manage_lifecycle=False)
    async with in_process_client(app, API_KEY) as client:
        yield client


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_nodes_describe_this_node_as_e2b_does(api: httpx.AsyncClient, node: Node) -> None:
    created = await api.post("/v2/sandboxes", json={"templateID": FAKE_TEMPLATE})
    assert created.status_code == 201, created.text
    assert (await api.post("/v2/sandboxes", json={"templateID": "nope"})).status_code == 400
    listed = (await api.get("/nodes")).json()
    assert len(listed) == 1
    me = listed[0]
    assert me["id"] == "node-a" and me["status"] == "ready"
    assert me["sandboxCount"] == 1 and me["sandboxStartingCount"] == 0
    assert (me["createSuccesses"], me["createFails"]) == (1, 1)
    metrics = me["metrics"]
    assert metrics["allocatedCPU"] == node.orchestrator.node_status().allocated_vcpus > 0
    assert metrics["cpuCount"] >= 1 and metrics["memoryTotalBytes"] > 0
    assert metrics["disks"][0]["totalBytes"] > 0
    assert set(me["machineInfo"]) == {"cpuFamily", "cpuModel", "cpuModelName", "cpuArchitecture"}
    detail = (await api.get("/nodes/node-a")).json()
    assert detail["sandboxes"] == [created.json()["sandboxID"]]
    assert FAKE_TEMPLATE in detail["cachedBuilds"]
    assert (await api.get("/nodes/node-z")).status_code == 404
    async with httpx.AsyncClient(transport=api._transport, base_url="http://api.test") as bare:
        assert (await bare.get("/nodes")).status_code == 401


async def test_health_tells_a_caller_without_the_key_only_that_the_node_is_up(
    api: httpx.AsyncClient,
) -> None:
    """A probe needs no key; a stranger learns no template, sandbox count, path or
    capacity from it. The key gets the whole status; a wrong key is refused."""
    created = await api.post("/v2/sandboxes", json={"templateID": FAKE_TEMPLATE})
    assert created.status_code == 201, created.text
    async with httpx.AsyncClient(transport=api._transport, base_url="http://api.test") as bare:
        anonymous = await bare.get("/health")
        assert anonymous.status_code == 200
        assert anonymous.json() == {"status": "ok", "version": __version__}
        for wrong in ({"X-API-Key": "nope"}, {"Authorization": "Bearer nope"}):
            refused = await bare.get("/health", headers=wrong)
            assert refused.status_code == 401 and refused.json()["code"] == 401
        bearer = await bare.get("/health", headers={"Authorization": f"Bearer {API_KEY}"})
        assert bearer.json()["sandboxes"] == 1
    full = (await api.get("/health")).json()
    assert full["sandboxes"] == 1 and FAKE_TEMPLATE in full["templates"]
    assert full["repository"] and full["vmm"]


async def test_metrics_need_the_key_and_count_what_the_node_did(api: httpx.AsyncClient) -> None:
    async with httpx.AsyncClient(transport=api._transport, base_url="http://api.test") as bare:
        refused = await bare.get("/metrics")
        assert refused.status_code == 401 and refused.json()["code"] == 401
        bearer = await bare.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        assert bearer.status_code == 200
    created = await api.post("/v2/sandboxes", json={"templateID": FAKE_TEMPLATE})
    sandbox_id = created.json()["sandboxID"]
    assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
    assert (await api.post(f"/sandboxes/{sandbox_id}/connect", json={})).status_code == 201
    answer = await api.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    got = samples(answer.text)
    for operation in ("create", "pause", "resume"):
        labels = (("operation", operation), ("outcome", "ok"))
        assert got[("aenv_sandbox_operation_seconds_count", labels)] == 1, operation
    assert got[("aenv_sandboxes", (("state", "running"),))] == 1
    assert got[("aenv_vmms", ())] == 1
    assert got[("aenv_sandbox_creates_total", (("outcome", "ok"),))] == 1
    assert ("aenv_cache_limit_bytes", ()) in got
    route = (
        "aenv_http_request_duration_seconds_count",
        (
            ("component", "node"),
            ("method", "POST"),
            ("route", "/sandboxes/{sandbox_id}/pause"),
            ("status", "204"),
        ),
    )
    assert got[route] == 1


async def test_a_heartbeat_carries_the_node_as_the_gateway_lists_it(node: Node) -> None:
    """A real node's report (its E2B description with datetimes) over HTTP to a
    scheduler, and the gateway's /nodes listing it."""
    registry = NodeRegistry(MemoryStore(), LeastLoaded(overcommit=4.0))
    scheduler_app = create_scheduler_app(registry, API_KEY)
    transport = httpx.ASGITransport(app=scheduler_app)
    scheduler = SchedulerClient("http://scheduler.test", API_KEY, transport=transport)
    book = NodeBook(node.orchestrator)
    info = await scheduler.heartbeat(node_report(node.orchestrator, node.config, book.node))
    assert info.report.e2b_node is not None and info.report.e2b_node.id == "node-a"
    gateway_scheduler = SchedulerClient("http://scheduler.test", API_KEY, transport=transport)
    gateway = Gateway(gateway_scheduler, API_KEY, None)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gateway), base_url="http://gw.test"
    ) as client:
        listed = (await client.get("/nodes", headers={"X-API-Key": API_KEY})).json()
    await gateway.aclose()
    await scheduler.aclose()
    assert [(n["id"], n["status"], n["serviceInstanceID"]) for n in listed] == [
        ("node-a", "ready", book.instance_id)
    ]
