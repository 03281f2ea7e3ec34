"""A local 3-node cluster (Redis, scheduler, gateway, three nodes sharing a repository),
as ``scripts/cluster up`` starts it, driven through the gateway with the unmodified
``e2b`` SDK. The tests share one cluster and run in order: the last kills a node."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import PtySize, Sandbox

from agentenv.client import AgentEnv
from agentenv.cluster.local import LocalCluster
from tests.cluster_support import running_cluster
from tests.helpers import envelope

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def cluster(test_root: Path, guest_image: None) -> Iterator[LocalCluster]:
    with running_cluster(
        test_root / "cluster",
        nodes=3,
        node_timeout=3.0,
        # A commit under TCG on a busy machine may take long; the wait covers it.
        node_env={"AENV_NETWORK_LINGER": "1", "AENV_COMMIT_WAIT": "170"},
    ) as local:
        yield local


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
    """One sandbox per node, created through the gateway one after the other."""
    return [Sandbox.create(timeout=600, **opts) for _ in range(cluster.nodes)]


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
    with scheduler(cluster) as sched:
        listed = sched.get("/nodes").json()
    return {n["report"]["nodeID"]: n["report"]["sandboxes"] for n in listed}


def owner(cluster: LocalCluster, sandbox_id: str) -> str:
    with scheduler(cluster) as sched:
        binding = sched.get(f"/bindings/{sandbox_id}")
    assert binding.status_code == 200, binding.text
    return str(binding.json()["nodeID"])


def node_api(cluster: LocalCluster, name: str) -> httpx.Client:
    """A client of one node directly, not through the gateway."""
    return httpx.Client(
        base_url=f"http://{cluster.procs[name].env['AENV_LISTEN']}",
        headers={"X-API-Key": cluster.api_key},
        timeout=240,
        trust_env=False,
    )


def test_creates_spread_over_the_nodes(cluster: LocalCluster, pair: list[Sandbox]) -> None:
    # The nodes are empty and alike: least-loaded placement puts each create on a node
    # the ones before did not take (a placement's reservation counts at once).
    assert {owner(cluster, s.sandbox_id) for s in pair} == {"node-0", "node-1", "node-2"}
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


def test_listing_pages_across_the_nodes(
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
        assert client.health().sandboxes == len(pair)
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


def test_a_pty_through_the_gateway(pair: list[Sandbox]) -> None:
    sbx = pair[-1]
    pty = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
    sbx.pty.send_stdin(pty.pid, b"stty size; echo pty-$((6*7)); exit 0\n")
    output = bytearray()
    assert pty.wait(on_pty=output.extend).exit_code == 0
    assert b"24 80" in output and b"pty-42" in output


def test_nodes_and_metrics_through_the_gateway(cluster: LocalCluster, pair: list[Sandbox]) -> None:
    with gateway(cluster) as api:
        listed = api.get("/nodes").json()
        assert sorted(n["id"] for n in listed) == ["node-0", "node-1", "node-2"]
        assert all(n["status"] == "ready" for n in listed)
        first = owner(cluster, pair[0].sandbox_id)
        detail = api.get(f"/nodes/{first}").json()
        assert pair[0].sandbox_id in detail["sandboxes"] and "base" in detail["cachedBuilds"]
        assert "aenv_gateway_upstream_seconds_count" in api.get("/metrics").text
    with node_api(cluster, first) as node:
        assert 'aenv_sandboxes{state="running"}' in node.get("/metrics").text


def test_pause_then_connect_at_once_through_the_gateway(
    cluster: LocalCluster, opts: dict[str, Any]
) -> None:
    sbx = Sandbox.create(timeout=600, **opts)
    node = owner(cluster, sbx.sandbox_id)
    sbx.files.write("/home/user/mark", "before the pause")
    sbx.beta_pause()
    again = Sandbox.connect(sbx.sandbox_id, **opts)  # its node is alive: it resumes there
    assert owner(cluster, sbx.sandbox_id) == node
    assert again.files.read("/home/user/mark") == "before the pause"
    again.kill()


def test_a_node_asked_right_after_another_paused_waits_for_the_commit(
    cluster: LocalCluster, opts: dict[str, Any]
) -> None:
    """Straight to the nodes, no gateway: paused on one, connected at once on another,
    which waits for the commit (it used to answer 404 until the commit landed)."""
    sbx = Sandbox.create(timeout=600, **opts)
    sbx.files.write("/home/user/mark", "moved")
    node = owner(cluster, sbx.sandbox_id)
    other = next(name for name in ("node-0", "node-1", "node-2") if name != node)
    with node_api(cluster, node) as paused_on, node_api(cluster, other) as taker:
        assert paused_on.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
        assert paused_on.get(f"/sandboxes/{sbx.sandbox_id}").json()["pauseCommitted"] is False
        connected = taker.post(f"/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 600})
        assert connected.status_code == 201, connected.text
        # The node it left drops its copy at its next handoff check (5 s); until then
        # both rosters hold it, and the binding settles once only the taker's does.
        wait_for(
            lambda: (
                paused_on.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 404
                and owner(cluster, sbx.sandbox_id) == other
            ),
            "the node it left to drop it and the binding to follow",
        )
        moved = Sandbox.connect(sbx.sandbox_id, **opts)
        assert moved.files.read("/home/user/mark") == "moved"
        assert taker.delete(f"/sandboxes/{sbx.sandbox_id}").status_code == 204


def test_a_gateway_restart_loses_nothing(
    cluster: LocalCluster, pair: list[Sandbox], opts: dict[str, Any]
) -> None:
    before = sorted(info.sandbox_id for info in Sandbox.list(**opts).next_items())
    cluster.restart("gateway")
    assert sorted(info.sandbox_id for info in Sandbox.list(**opts).next_items()) == before
    for sbx in pair:
        assert sbx.commands.run("echo after the restart").stdout == "after the restart\n"


def test_a_scheduler_without_redis_rebuilds_bindings_from_heartbeats(
    cluster: LocalCluster, pair: list[Sandbox]
) -> None:
    before = {s.sandbox_id: owner(cluster, s.sandbox_id) for s in pair}
    proc = cluster.procs["scheduler"]
    with_redis = proc.argv
    at = with_redis.index("--redis")
    proc.argv = with_redis[:at] + with_redis[at + 2 :]  # bindings in memory: lost on restart
    try:
        cluster.restart("scheduler")

        def rebuilt() -> bool:
            with scheduler(cluster) as sched:
                answers = [sched.get(f"/bindings/{sandbox_id}") for sandbox_id in before]
            if any(a.status_code != 200 for a in answers):
                return False
            return [a.json()["nodeID"] for a in answers] == list(before.values())

        wait_for(rebuilt, "the heartbeats to rebuild every binding")
        for sbx in pair:
            assert sbx.commands.run("echo rebuilt").stdout == "rebuilt\n"
    finally:
        proc.argv = with_redis
        cluster.restart("scheduler")


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
    # Frozen, they went silent and so down; their next heartbeats bring them back.
    with httpx.Client(trust_env=False, timeout=30) as http:
        wait_for(
            lambda: len(cluster.nodes_up(http)) == cluster.nodes, "the nodes to heartbeat again"
        )
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
    assert sorted(listed) == sorted(s.sandbox_id for s in pair)


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
