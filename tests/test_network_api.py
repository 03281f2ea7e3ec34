"""E2B's network options through the API, the orchestrator and the proxy's admission, on
the fakes of :mod:`tests.fakes` (no root, no VMs): parsing and the 400s that name an
option, what the record keeps across pause, restart, fork and handoff, ``PUT
/sandboxes/{id}/network``, the traffic access token, ``maskRequestHost`` and Host routing
under the configured domain. ``tests/security/test_network_api.py`` does the same
against real VMs."""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.datastructures import Headers

from agentenv.api.app import create_app
from agentenv.config import Config
from agentenv.network import EgressPolicy, NetworkError
from agentenv.orchestrator.network_options import NetworkOptions, traffic_token_matches
from agentenv.orchestrator.records import PausedEntry
from agentenv.orchestrator.store import Store
from agentenv.proxy.forward import ProxyTarget, SandboxProxy, target_of
from agentenv.proxy.paths import RequestPath
from agentenv.proxy.relay import Refusal
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


async def _create(api: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    created = await api.post("/v2/sandboxes", json={"templateID": FAKE_TEMPLATE, **body})
    assert created.status_code == 201, created.text
    result: dict[str, Any] = created.json()
    return result


def _slot(node: Node, sandbox_id: str) -> int:
    rec = node.orchestrator.store.get_sandbox(sandbox_id)
    assert rec is not None
    return rec.slot


# -- create ------------------------------------------------------------------------------------
async def test_create_enforces_and_shows_the_network_options(
    api: httpx.AsyncClient, node: Node
) -> None:
    network = {
        "allowOut": ["1.1.1.1", "api.example.com"],
        "denyOut": ["0.0.0.0/0"],
        "dnsServers": ["1.1.1.1"],
        "allowPublicTraffic": False,
        "maskRequestHost": "${PORT}-app.example.com",
    }
    sandbox = await _create(api, network=network)
    sandbox_id = sandbox["sandboxID"]
    assert sandbox["trafficAccessToken"]
    assert node.network.policies[_slot(node, sandbox_id)] == EgressPolicy.parse(
        allow_internet=True,
        allow_out=["1.1.1.1", "api.example.com"],
        deny_out=["0.0.0.0/0"],
        dns_servers=["1.1.1.1"],
    )
    detail = (await api.get(f"/sandboxes/{sandbox_id}")).json()
    assert detail["allowInternetAccess"] is True
    assert detail["network"] == {
        "allowPublicTraffic": False,
        "allowOut": ["1.1.1.1/32", "api.example.com"],
        "denyOut": ["0.0.0.0/0"],
        "dnsServers": ["1.1.1.1"],
        "maskRequestHost": "${PORT}-app.example.com",
    }


async def test_create_defaults_are_e2bs(api: httpx.AsyncClient, node: Node) -> None:
    """Internet and public traffic allowed, no traffic token; ``allow_internet_access``
    false closes egress."""
    open_one = await _create(api)
    assert open_one["trafficAccessToken"] is None
    assert node.network.policies[_slot(node, open_one["sandboxID"])] == EgressPolicy(
        allow_internet=True
    )
    closed = await _create(api, allow_internet_access=False)
    assert node.network.policies[_slot(node, closed["sandboxID"])] == EgressPolicy()
    detail = (await api.get(f"/sandboxes/{closed['sandboxID']}")).json()
    assert detail["allowInternetAccess"] is False
    assert detail["network"]["allowPublicTraffic"] is True


@pytest.mark.parametrize(
    ("network", "named"),
    [
        ({"egressProxy": {"address": "proxy.example.com:1080"}}, "network.egressProxy"),
        ({"rules": {"api.example.com": [{"transform": {"headers": {"X": "y"}}}]}}, "rules"),
        ({"httpsPorts": [3000]}, "network.httpsPorts"),
        ({"somethingNew": True}, "network.somethingNew"),
        ({"allowOut": ["not a host!"]}, "allowOut"),
        ({"denyOut": ["2001:db8::/32"]}, "denyOut"),
        ({"dnsServers": ["dns.example.com"]}, "dnsServers"),
        ({"dnsServers": []}, "dnsServers"),
        ({"maskRequestHost": "a.example.com\r\nX-Evil: 1"}, "maskRequestHost"),
        ({"maskRequestHost": "a.example.com/path"}, "maskRequestHost"),
    ],
)
async def test_what_is_not_supported_is_refused_by_name(
    api: httpx.AsyncClient, node: Node, network: dict[str, Any], named: str
) -> None:
    for path in ("/v2/sandboxes", "/sandboxes"):
        refused = await api.post(path, json={"templateID": FAKE_TEMPLATE, "network": network})
        assert refused.status_code == 400, refused.text
        assert named in refused.json()["message"]
    assert node.orchestrator.list_sandboxes() == []


async def test_empty_unsupported_options_are_none(api: httpx.AsyncClient) -> None:
    """What the SDK sends for options left empty asks for nothing."""
    await _create(api, network={"rules": {}, "httpsPorts": [], "egressProxy": None})


# -- PUT /sandboxes/{id}/network -------------------------------------------------------------
async def test_update_replaces_the_egress_rules(api: httpx.AsyncClient, node: Node) -> None:
    sandbox = await _create(
        api, network={"allowPublicTraffic": False, "maskRequestHost": "m.example.com"}
    )
    sandbox_id = sandbox["sandboxID"]
    # The body e2b's Sandbox.update_network sends.
    body = {"allowOut": ["8.8.8.8"], "denyOut": ["0.0.0.0/0"], "allow_internet_access": True}
    updated = await api.put(f"/sandboxes/{sandbox_id}/network", json=body)
    assert updated.status_code == 204, updated.text
    wanted = EgressPolicy.parse(allow_internet=True, allow_out=["8.8.8.8"], deny_out=["0.0.0.0/0"])
    assert node.network.policies[_slot(node, sandbox_id)] == wanted
    detail = (await api.get(f"/sandboxes/{sandbox_id}")).json()
    assert detail["network"]["allowOut"] == ["8.8.8.8/32"]
    # Only the egress rules change: the proxy-side options and the token stay.
    assert detail["network"]["allowPublicTraffic"] is False
    assert detail["network"]["maskRequestHost"] == "m.example.com"
    rec = node.orchestrator.store.get_sandbox(sandbox_id)
    assert rec is not None and rec.traffic_token == sandbox["trafficAccessToken"]
    # What an update leaves out is cleared, allow_internet_access included (E2B's default).
    cleared = await api.put(f"/sandboxes/{sandbox_id}/network", json={})
    assert cleared.status_code == 204
    assert node.network.policies[_slot(node, sandbox_id)] == EgressPolicy(allow_internet=True)
    closed = await api.put(
        f"/sandboxes/{sandbox_id}/network", json={"allow_internet_access": False}
    )
    assert closed.status_code == 204
    assert node.network.policies[_slot(node, sandbox_id)] == EgressPolicy()


async def test_update_refusals(api: httpx.AsyncClient, node: Node) -> None:
    sandbox_id = (await _create(api))["sandboxID"]
    url = f"/sandboxes/{sandbox_id}/network"
    assert (await api.put("/sandboxes/inope/network", json={})).status_code == 404
    for body, named in [
        ({"allowOut": ["::1"]}, "allowOut"),
        ({"egressProxy": {"address": "p:1080"}}, "egressProxy"),
        ({"rules": {"a.example.com": [{"transform": {"headers": {"X": "y"}}}]}}, "rules"),
        ({"allowPublicTraffic": False}, "allowPublicTraffic"),
    ]:
        refused = await api.put(url, json=body)
        assert refused.status_code == 400, (body, refused.text)
        assert named in refused.json()["message"]
    assert node.network.policies[_slot(node, sandbox_id)] == EgressPolicy(allow_internet=True)
    # No key, no change.
    anonymous = await api.put(url, json={}, headers={"X-API-Key": "wrong"})
    assert anonymous.status_code == 401


async def test_update_of_a_paused_sandbox_is_a_conflict(api: httpx.AsyncClient, node: Node) -> None:
    sandbox_id = (await _create(api))["sandboxID"]
    await node.orchestrator.pause(sandbox_id)
    refused = await api.put(f"/sandboxes/{sandbox_id}/network", json={"denyOut": ["0.0.0.0/0"]})
    assert refused.status_code == 409, refused.text
    rec = node.orchestrator.store.get_sandbox(sandbox_id)
    assert rec is not None and rec.network.egress == EgressPolicy(allow_internet=True)


async def test_an_update_the_network_cannot_apply_changes_nothing(
    api: httpx.AsyncClient, node: Node
) -> None:
    sandbox_id = (await _create(api))["sandboxID"]
    node.network.fail_next("update_policy", NetworkError("not implemented yet"))
    failed = await api.put(f"/sandboxes/{sandbox_id}/network", json={"denyOut": ["0.0.0.0/0"]})
    assert failed.status_code == 500
    assert "not implemented yet" in failed.json()["message"]
    rec = node.orchestrator.store.get_sandbox(sandbox_id)
    assert rec is not None and rec.network.egress == EgressPolicy(allow_internet=True)


# -- persistence -----------------------------------------------------------------------------
CLOSED = NetworkOptions(
    EgressPolicy.parse(allow_internet=False, allow_out=["10.1.2.0/24", "*.example.com"]),
    allow_public_traffic=False,
    mask_request_host="${PORT}.mask.test",
)


async def test_options_survive_pause_resume_restart_and_fork(tmp_path: Path) -> None:
    node = await start_node(tmp_path / "a", tmp_path / "repository")
    try:
        view = await node.orchestrator.create(FAKE_TEMPLATE, network=CLOSED)
        sandbox_id = view.sandbox_id
        token = view.record.traffic_token
        assert token and view.record.network == CLOSED
        await node.orchestrator.pause(sandbox_id)
        await asyncio.sleep(0.2)  # past the linger: the resume builds the network anew
        assert view.record.slot not in node.network.live
        resumed = await node.orchestrator.resume(sandbox_id)
        assert node.network.policies[resumed.record.slot] == CLOSED.egress
        assert resumed.record.network == CLOSED and resumed.record.traffic_token == token

        children = await node.orchestrator.fork(sandbox_id, 2)
        tokens = set()
        for child in children:
            assert not isinstance(child, Exception), child
            assert child.record.network == CLOSED
            assert node.network.policies[child.record.slot] == CLOSED.egress
            assert child.record.traffic_token not in (None, token)
            tokens.add(child.record.traffic_token)
        assert len(tokens) == 2
    finally:
        await node.stop()
    after = await start_node(
        tmp_path / "a", tmp_path / "repository", network=node.network, template=False
    )
    try:
        rec = after.orchestrator.store.get_sandbox(sandbox_id)
        assert rec is not None and rec.network == CLOSED and rec.traffic_token == token
    finally:
        await after.stop()


async def test_options_survive_a_handoff(tmp_path: Path) -> None:
    repository = tmp_path / "repository"

    def shared_key(config: Config) -> Config:
        # Nodes that resume each other's sandboxes derive tokens from one key.
        return config.with_overrides(envd_token_key="5e" * 32)

    a = await start_node(
        tmp_path / "a", repository, node_id="node-a", watch_handoffs=False, configure=shared_key
    )
    b = await start_node(
        tmp_path / "b",
        repository,
        node_id="node-b",
        template=False,
        watch_handoffs=False,
        configure=shared_key,
    )
    try:
        view = await a.orchestrator.create(FAKE_TEMPLATE, network=CLOSED)
        await a.orchestrator.pause(view.sandbox_id)
        upload = a.orchestrator.pending_upload(view.sandbox_id)
        if upload is not None:
            await asyncio.wait_for(upload, 30)
        adopted = await b.orchestrator.adopt(view.sandbox_id)
        assert adopted.record.network == CLOSED
        assert adopted.record.traffic_token == view.record.traffic_token
        assert b.network.policies[adopted.record.slot] == CLOSED.egress
    finally:
        await a.stop()
        await b.stop()


def test_paused_records_from_older_servers_keep_their_internet_setting() -> None:
    wire = {
        "sandbox_id": "iold",
        "generation": 1,
        "template_id": "base",
        "template_build_id": "b1",
        "allow_internet": True,
        "envd_version": "0.6.4",
        "started_at": "2026-01-01T00:00:00+00:00",
        "end_at": "2026-01-01T00:00:00+00:00",
        "paused_at": "2026-01-01T00:00:00+00:00",
        "manifest": {},
        "blobs": {},
    }
    entry = PausedEntry.from_wire(wire)
    assert entry.network is None and entry.allow_internet
    with_options = PausedEntry.from_wire({**wire, "network": CLOSED.to_dict()})
    assert with_options.network is not None
    assert NetworkOptions.from_dict(with_options.network) == CLOSED


def test_store_migrates_allow_internet_into_network_options(tmp_path: Path) -> None:
    """Rows from before the network column get the options their allow_internet meant."""
    db = sqlite3.connect(tmp_path / "state.db")
    db.executescript(
        "CREATE TABLE sandboxes (sandbox_id TEXT PRIMARY KEY, template_id TEXT NOT NULL,"
        " template_build_id TEXT NOT NULL, state TEXT NOT NULL, slot INTEGER NOT NULL UNIQUE,"
        " workdir TEXT NOT NULL, started_at TEXT NOT NULL, end_at TEXT NOT NULL,"
        " vcpus INTEGER NOT NULL, memory_mib INTEGER NOT NULL, disk_size_mib INTEGER NOT NULL,"
        " envd_version TEXT NOT NULL, envd_token TEXT, metadata TEXT NOT NULL,"
        " env_vars TEXT NOT NULL, auto_pause INTEGER NOT NULL DEFAULT 0,"
        " allow_internet INTEGER NOT NULL DEFAULT 0);"
        "INSERT INTO sandboxes VALUES ('iopen', 'base', 'b1', 'paused', 0, '/x',"
        " '2026-01-01T00:00:00+00:00', '2026-01-01T00:00:00+00:00', 1, 512, 1, '0.6.4',"
        " NULL, '{}', '{}', 0, 1);"
        "INSERT INTO sandboxes VALUES ('ishut', 'base', 'b1', 'paused', 1, '/y',"
        " '2026-01-01T00:00:00+00:00', '2026-01-01T00:00:00+00:00', 1, 512, 1, '0.6.4',"
        " NULL, '{}', '{}', 0, 0);"
    )
    db.close()
    store = Store(tmp_path / "state.db")
    store.open()
    opened, shut = store.get_sandbox("iopen"), store.get_sandbox("ishut")
    assert opened is not None and opened.network == NetworkOptions(EgressPolicy(True))
    assert shut is not None and shut.network == NetworkOptions(EgressPolicy(False))
    assert opened.traffic_token is None
    stored = store.db.execute("SELECT network FROM sandboxes WHERE sandbox_id='iopen'")
    assert json.loads(stored.fetchone()[0])["egress"]["allowInternet"] is True
    store.close()


# -- the proxy's admission -------------------------------------------------------------------
def _headers(**values: str) -> Headers:
    return Headers({k.replace("_", "-"): v for k, v in values.items()})


def test_host_routing_only_under_the_configured_domain() -> None:
    domain = "Sandbox.Test:8443"
    wanted = ProxyTarget("iabc123", 8080)
    for host in (
        "8080-iabc123.sandbox.test",
        "8080-iabc123.sandbox.test:8443",
        "8080-iabc123.SANDBOX.TEST:1234",
        "8080-iabc123.sandbox.test.",
    ):
        assert target_of(_headers(host=host), domain) == wanted, host
    for host in (
        "8080-iabc123.anything",
        "8080-iabc123.sandbox.test.evil.example",
        "8080-iabc123.evilsandbox.test",
        "8080-iabc123.x.sandbox.test",
        "api.sandbox.test",
        "sandbox.test",
    ):
        assert target_of(_headers(host=host), domain) is None, host
    # Without a configured domain no Host routes: only the headers do.
    assert target_of(_headers(host="8080-iabc123.sandbox.test"), None) is None
    routed = _headers(host="whatever", e2b_sandbox_id="iabc123", e2b_sandbox_port="8080")
    assert target_of(routed, None) == wanted
    assert target_of(routed, domain) == wanted


async def test_traffic_token_guards_every_port_but_envds(node: Node) -> None:
    proxy = SandboxProxy(node.orchestrator)
    closed = await node.orchestrator.create(FAKE_TEMPLATE, network=CLOSED, secure=True)
    public = await node.orchestrator.create(FAKE_TEMPLATE, network=NetworkOptions())
    token = closed.record.traffic_token
    assert token is not None
    path = RequestPath(b"/", "/")

    async def admitted(view_id: str, port: int, **headers: str) -> bool:
        result = await proxy.admit(ProxyTarget(view_id, port), path, _headers(**headers))
        if isinstance(result, Refusal):
            assert result.status == (401 if port == 49983 else 403), result
            return False
        return True

    for port in (8080, 49999, 1):
        assert not await admitted(closed.sandbox_id, port)
        assert not await admitted(closed.sandbox_id, port, e2b_traffic_access_token="")
        assert not await admitted(closed.sandbox_id, port, e2b_traffic_access_token=token + "x")
        assert not await admitted(
            closed.sandbox_id, port, e2b_traffic_access_token=closed.record.envd_token or ""
        )
        assert await admitted(closed.sandbox_id, port, e2b_traffic_access_token=token)
        assert await admitted(public.sandbox_id, port)
    # envd's port keeps its own rule: the envd token, not the traffic token.
    assert not await admitted(closed.sandbox_id, 49983, e2b_traffic_access_token=token)
    assert await admitted(closed.sandbox_id, 49983, x_access_token=closed.record.envd_token or "")
    await proxy.aclose()


async def test_a_refused_request_does_not_wake_a_paused_sandbox(node: Node) -> None:
    view = await node.orchestrator.create(
        FAKE_TEMPLATE, network=CLOSED, auto_resume=True, auto_pause=True
    )
    await node.orchestrator.pause(view.sandbox_id)
    proxy = SandboxProxy(node.orchestrator)
    refused = await proxy.admit(
        ProxyTarget(view.sandbox_id, 8080), RequestPath(b"/", "/"), _headers()
    )
    assert isinstance(refused, Refusal) and refused.status == 403
    assert node.orchestrator.get(view.sandbox_id).state == "paused"
    await proxy.aclose()


def test_mask_request_host_and_tokens() -> None:
    assert CLOSED.forwarded_host(8080) == "8080.mask.test"
    assert NetworkOptions().forwarded_host(8080) is None
    assert not traffic_token_matches(None, None)
    assert not traffic_token_matches(None, "")
    assert not traffic_token_matches("t", None)
    assert traffic_token_matches("t", "t")
