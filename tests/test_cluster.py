"""A local 2-node cluster (Redis, scheduler, gateway, two nodes sharing a repository), as
``scripts/cluster up`` starts it, driven through the gateway with the unmodified ``e2b``
SDK. The tests share one cluster and run in order: the last kills a node."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from agentenv.client import AgentEnv
from agentenv.cluster.local import LocalCluster
from tests.helpers import cleanup_host, envelope

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def cluster(test_root: Path, guest_image: None) -> Iterator[LocalCluster]:
    local = LocalCluster(
        test_root / "cluster",
        nodes=2,
        heartbeat_interval=0.5,
        node_timeout=3.0,
        node_env={"AENV_NETWORK_LINGER": "1"},
    )
    try:
        local.up()
        yield local
    finally:
        local.down()
        for index in range(local.nodes):
            cleanup_host(local.root / local.node_name(index))


@pytest.fixture(scope="module")
def opts(cluster: LocalCluster) -> dict[str, Any]:
    return {
        "debug": False,
        "api_url": cluster.gateway_url,
        "sandbox_url": cluster.gateway_url,
        "api_key": cluster.api_key,
    }


@pytest.fixture(scope="module")
def pair(cluster: LocalCluster, opts: dict[str, Any]) -> list[Sandbox]:
    """Two sandboxes created through the gateway, one after the other."""
    return [Sandbox.create(timeout=600, **opts) for _ in range(2)]


def gateway(cluster: LocalCluster) -> httpx.Client:
    return httpx.Client(
        base_url=cluster.gateway_url,
        headers={"X-API-Key": cluster.api_key},
        timeout=120,
        trust_env=False,
    )


def scheduler(cluster: LocalCluster) -> httpx.Client:
    return httpx.Client(
        base_url=cluster.scheduler_url,
        headers={"X-API-Key": cluster.api_key},
        timeout=30,
        trust_env=False,
    )


def wait_for(check: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def rosters(cluster: LocalCluster) -> dict[str, list[str]]:
    with gateway(cluster) as api:
        return {n["report"]["nodeID"]: n["report"]["sandboxes"] for n in api.get("/nodes").json()}


def owner(cluster: LocalCluster, sandbox_id: str) -> str:
    with scheduler(cluster) as sched:
        binding = sched.get(f"/bindings/{sandbox_id}")
    assert binding.status_code == 200, binding.text
    return str(binding.json()["nodeID"])


def test_two_creates_land_on_different_nodes(cluster: LocalCluster, pair: list[Sandbox]) -> None:
    # Both nodes are empty and alike: least-loaded placement puts the second create on
    # the node the first did not take (the first's reservation counts at once).
    assert {owner(cluster, s.sandbox_id) for s in pair} == {"node-0", "node-1"}
    wait_for(
        lambda: all(s.sandbox_id in rosters(cluster)[owner(cluster, s.sandbox_id)] for s in pair),
        "the nodes' heartbeats to report their sandboxes",
    )


def test_commands_and_files_through_the_gateway(cluster: LocalCluster, pair: list[Sandbox]) -> None:
    for index, sbx in enumerate(pair):
        result = sbx.commands.run(f"echo node says {index}")
        assert result.exit_code == 0 and result.stdout == f"node says {index}\n"
        payload = bytes(range(256)) * 4096  # 1 MiB, streamed both ways
        sbx.files.write(f"/tmp/blob-{index}", payload)
        assert sbx.files.read(f"/tmp/blob-{index}", format="bytes") == payload
    # Host routing: `{port}-{id}.{domain}` through the gateway reaches envd's /health.
    first = pair[0]
    answer = httpx.get(
        f"{cluster.gateway_url}/health",
        headers={"Host": first.get_host(49983)},
        trust_env=False,
        timeout=30,
    )
    assert answer.status_code in (200, 204), answer.text


def test_signed_urls_through_the_gateway(cluster: LocalCluster, pair: list[Sandbox]) -> None:
    """The SDK's signed URLs name no sandbox through E2B_SANDBOX_URL: the gateway finds
    the node whose sandbox signed them."""
    for index, sbx in enumerate(pair):
        sbx.files.write("/tmp/signed.txt", f"sandbox {index}")
        url = sbx.download_url("/tmp/signed.txt", use_signature_expiration=120)
        assert url.startswith(f"{cluster.gateway_url}/files?")
        got = httpx.get(url, trust_env=False, timeout=60)
        assert (got.status_code, got.text) == (200, f"sandbox {index}")
        up = sbx.upload_url("/tmp/up.txt", use_signature_expiration=120)
        sent = httpx.post(up, files={"file": ("f", f"up {index}".encode())}, trust_env=False)
        assert sent.status_code == 200, sent.text
        assert sbx.files.read("/tmp/up.txt") == f"up {index}"
        tampered = url.replace("signature=v1_", "signature=v1_A")
        assert httpx.get(tampered, trust_env=False, timeout=60).status_code == 401
    unsigned = httpx.get(f"{cluster.gateway_url}/files", params={"path": "/etc/hostname"})
    assert unsigned.status_code == 400


def test_listing_pages_across_both_nodes(
    cluster: LocalCluster, pair: list[Sandbox], opts: dict[str, Any]
) -> None:
    paginator = Sandbox.list(limit=1, **opts)
    seen: list[str] = []
    while paginator.has_next:
        seen += [info.sandbox_id for info in paginator.next_items()]
    assert sorted(seen) == sorted(s.sandbox_id for s in pair)
    with gateway(cluster) as api:
        assert {d["sandboxID"] for d in api.get("/sandboxes").json()} == set(seen)
    # agentenv's own client (what `aenv` is built on) through the gateway too.
    with AgentEnv(cluster.gateway_url, cluster.api_key) as client:
        assert client.health().sandboxes == 2
        assert {s.sandbox_id for s in client.list_sandboxes()} == set(seen)


def test_fork_children_are_bound_to_the_parents_node(
    cluster: LocalCluster, pair: list[Sandbox]
) -> None:
    parent = pair[0]
    with gateway(cluster) as api:
        forked = api.post(f"/sandboxes/{parent.sandbox_id}/fork", json={"count": 1})
        assert forked.status_code == 201, forked.text
        child = forked.json()[0]["sandbox"]["sandboxID"]
        try:
            assert owner(cluster, child) == owner(cluster, parent.sandbox_id)
            token = forked.json()[0]["sandbox"]["envdAccessToken"]
            ran = api.post(
                "/process.Process/Start",
                content=envelope({"process": {"cmd": "/bin/true"}, "stdin": False}),
                headers={
                    "Content-Type": "application/connect+json",
                    "Connect-Protocol-Version": "1",
                    "E2b-Sandbox-Id": child,
                    "X-Access-Token": token,
                },
            )
            assert ran.status_code == 200, ran.text
        finally:
            assert api.delete(f"/sandboxes/{child}").status_code == 204


def test_a_scheduler_restart_with_redis_loses_no_binding(
    cluster: LocalCluster, pair: list[Sandbox]
) -> None:
    before = {s.sandbox_id: owner(cluster, s.sandbox_id) for s in pair}
    # The nodes are frozen, so no heartbeat can rebuild the bindings: what the restarted
    # scheduler knows comes from Redis. (Their VMMs are other processes and keep running.)
    nodes = [proc for name, proc in cluster.procs.items() if name.startswith("node-")]
    for proc in nodes:
        os.kill(proc.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        cluster.restart("scheduler")
        assert {s.sandbox_id: owner(cluster, s.sandbox_id) for s in pair} == before
    finally:
        for proc in nodes:
            os.kill(proc.pid, signal.SIGCONT)  # type: ignore[arg-type]
    for sbx in pair:
        assert sbx.commands.run("echo still here").stdout == "still here\n"


def test_kill_through_the_gateway(
    cluster: LocalCluster, pair: list[Sandbox], opts: dict[str, Any]
) -> None:
    victim = pair.pop()
    victim.kill()
    with scheduler(cluster) as sched:
        assert sched.get(f"/bindings/{victim.sandbox_id}").status_code == 404
    with gateway(cluster) as api:
        assert api.get(f"/sandboxes/{victim.sandbox_id}").status_code == 404
    listed = [info.sandbox_id for info in Sandbox.list(**opts).next_items()]
    assert listed == [pair[0].sandbox_id]


def test_a_killed_node_makes_its_running_sandbox_503_and_its_paused_one_move(
    cluster: LocalCluster, pair: list[Sandbox], opts: dict[str, Any]
) -> None:
    survivor = pair[0]
    node = owner(cluster, survivor.sandbox_id)
    with gateway(cluster) as api:
        # A paused sandbox on the same node (a fork child lands on its parent's).
        forked = api.post(f"/sandboxes/{survivor.sandbox_id}/fork", json={"count": 1})
        assert forked.status_code == 201, forked.text
        paused = forked.json()[0]["sandbox"]["sandboxID"]
        assert owner(cluster, paused) == node
        Sandbox.connect(paused, **opts).commands.run("echo kept > /home/user/mark")
        assert api.post(f"/sandboxes/{paused}/pause").status_code == 204
        wait_for(
            lambda: api.get(f"/sandboxes/{paused}").json().get("pauseCommitted") is True,
            "the pause to be committed to the repository",
            limit=180,
        )
    cluster.procs[node].stop(signal.SIGKILL)
    headers = {"E2b-Sandbox-Id": survivor.sandbox_id, "X-Access-Token": "x"}

    def answers() -> list[httpx.Response]:
        with gateway(cluster) as api:
            return [
                api.get(f"/sandboxes/{survivor.sandbox_id}"),
                api.get("/health", headers=headers),
            ]

    for answer in answers():  # before the scheduler notices: the node does not answer
        assert answer.status_code == 503, answer.text
        assert answer.json()["message"].startswith("node unavailable"), answer.text
    with scheduler(cluster) as sched:
        wait_for(
            lambda: sched.get(f"/nodes/{node}").json()["state"] == "down",
            "the scheduler to mark the node down",
        )
    for answer in answers():
        assert answer.status_code == 503, answer.text
        assert "stopped heartbeating" in answer.json()["message"], answer.text
    # The committed paused sandbox resumes on the other node, with its disk.
    moved = Sandbox.connect(paused, **opts)
    assert owner(cluster, paused) != node
    assert moved.commands.run("cat /home/user/mark").stdout == "kept\n"
    moved.kill()
