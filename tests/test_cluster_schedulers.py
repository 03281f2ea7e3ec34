"""A local 2-node cluster with two scheduler replicas on one real redis-server
(``scripts/cluster up --schedulers 2``): the gateway and the nodes are given both. The
replica everybody calls first is killed with SIGKILL while sandboxes are being created
through the gateway with the unmodified ``e2b`` SDK: every create still succeeds, every
sandbox is bound once, to the node that holds it, nodes stay up through the other
replica, and the killed one, started again, knows everything at once (it is in Redis)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox
from prometheus_client.parser import text_string_to_metric_families

from agentenv.cluster.local import LocalCluster
from tests.cluster_support import running_cluster
from tests.e2b.support import wait_until

pytestmark = pytest.mark.vm

CREATES = 4


@pytest.fixture(scope="module")
def cluster(test_root: Path, guest_image: None) -> Iterator[LocalCluster]:
    with running_cluster(test_root / "replicas-cluster", nodes=2, schedulers=2) as local:
        yield local


def scheduler_get(url: str, cluster: LocalCluster, path: str) -> Any:
    answer = httpx.get(
        f"{url}{path}", headers={"X-API-Key": cluster.api_key}, trust_env=False, timeout=30
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_replica_killed_mid_run_loses_nothing(cluster: LocalCluster) -> None:
    first, second = cluster.scheduler_urls
    opts: dict[str, Any] = {
        "debug": False,
        "api_url": cluster.gateway_url,
        "sandbox_url": cluster.gateway_url,
        "api_key": cluster.api_key,
    }
    # Both replicas see both nodes, whichever one their heartbeats reach.
    for url in (first, second):
        nodes = scheduler_get(url, cluster, "/nodes")
        assert [(n["report"]["nodeID"], n["state"]) for n in nodes] == [
            ("node-0", "up"),
            ("node-1", "up"),
        ]
    created: list[Sandbox] = []
    failures: list[BaseException] = []
    first_done = threading.Event()

    def create_all() -> None:
        for _ in range(CREATES):
            try:
                created.append(Sandbox.create(timeout=600, **opts))
            except BaseException as exc:  # reported by the test below
                failures.append(exc)
            first_done.set()

    creator = threading.Thread(target=create_all)
    creator.start()
    try:
        # Once one create is through, the next one is on its way: kill the replica that
        # the gateway and the nodes call first, without letting it say anything.
        assert first_done.wait(300), "the first create did not finish"
        pid = cluster.procs["scheduler"].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        created_before_the_kill = len(created)
    finally:
        creator.join(900)
    assert not creator.is_alive()
    assert failures == []
    assert created_before_the_kill < CREATES
    # The creates after the kill were placed by the other replica.
    metrics = httpx.get(
        f"{second}/metrics", headers={"X-API-Key": cluster.api_key}, trust_env=False, timeout=30
    ).text
    placed = sum(
        sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "aenv_scheduler_placements_total"
        and sample.labels.get("outcome") == "placed"
    )
    assert placed >= CREATES - created_before_the_kill - 1
    ids = [sbx.sandbox_id for sbx in created]
    assert len(set(ids)) == CREATES

    # The other replica: both nodes stay up (their heartbeats moved to it), and every
    # sandbox is bound to the one node whose roster holds it.
    def settled() -> bool:
        nodes = scheduler_get(second, cluster, "/nodes")
        rosters = [set(n["report"]["sandboxes"]) for n in nodes]
        return all(n["state"] == "up" for n in nodes) and set(ids) <= set().union(*rosters)

    wait_until(settled, "both nodes to report through the surviving replica", limit=90)
    nodes = scheduler_get(second, cluster, "/nodes")
    holders = {n["report"]["nodeID"]: set(n["report"]["sandboxes"]) for n in nodes}
    assert not holders["node-0"] & holders["node-1"]
    for sandbox_id in ids:
        bound = scheduler_get(second, cluster, f"/bindings/{sandbox_id}")["nodeID"]
        assert sandbox_id in holders[bound]
    # No create was made twice: the nodes hold exactly the sandboxes created.
    assert holders["node-0"] | holders["node-1"] == set(ids)
    # Every sandbox works through the gateway, which now asks the other replica.
    for index, sbx in enumerate(created):
        assert sbx.commands.run(f"echo {index}").stdout == f"{index}\n"

    # The killed replica, started again, answers from Redis at once.
    cluster.restart("scheduler")
    for sandbox_id in ids:
        assert scheduler_get(first, cluster, f"/bindings/{sandbox_id}")["nodeID"] in holders
    with httpx.Client(
        base_url=cluster.gateway_url,
        headers={"X-API-Key": cluster.api_key},
        trust_env=False,
        timeout=120,
    ) as gateway:
        for sandbox_id in ids:
            assert gateway.delete(f"/sandboxes/{sandbox_id}").status_code == 204
        assert gateway.get("/v2/sandboxes").json() == []
