"""A local 2-node cluster over TLS (``scripts/cluster up --tls``): every component serves
HTTPS with a certificate of a throw-away CA and verifies the others with it; the gateway
reaches the nodes over HTTPS. The unmodified ``e2b`` SDK, given ``E2B_DOMAIN`` and the CA
alone, drives a sandbox on each node through the gateway (``cluster_tls_client``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.cluster.local import LocalCluster
from tests.cluster_support import running_cluster

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def cluster(test_root: Path, guest_image: None) -> Iterator[LocalCluster]:
    with running_cluster(test_root / "tls-cluster", nodes=2, tls=True) as local:
        yield local


def scheduler_get(cluster: LocalCluster, path: str) -> Any:
    answer = httpx.get(
        f"{cluster.scheduler_url}{path}",
        headers={"X-API-Key": cluster.api_key},
        verify=cluster.verify(),
        trust_env=False,
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_every_component_speaks_tls_only(cluster: LocalCluster) -> None:
    nodes = scheduler_get(cluster, "/nodes")
    assert sorted(n["report"]["nodeID"] for n in nodes) == ["node-0", "node-1"]
    assert all(n["report"]["url"].startswith("https://127.0.0.1:") for n in nodes)
    for url in (cluster.gateway_url, cluster.scheduler_url, nodes[0]["report"]["url"]):
        assert url.startswith("https://")
        plain = "http://" + url.removeprefix("https://")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{plain}/health", trust_env=False, timeout=10)
        # Without the cluster's CA the certificate is not trusted.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", trust_env=False, timeout=10)


def test_the_sdk_with_e2b_domain_through_a_tls_gateway(cluster: LocalCluster) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "SSL_CERT_"))}
    env.update(cluster.client_env())
    assert env["E2B_DOMAIN"] == cluster.domain and "E2B_API_URL" not in env
    # As a module from the checkout's root: from tests/, `e2b` would be tests/e2b.
    done = subprocess.run(
        [sys.executable, "-m", "tests.cluster_tls_client", str(cluster.nodes)],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    flows = seen["flows"]
    ids = [flow["sandbox_id"] for flow in flows]
    # Placement spread them over both nodes, which the gateway reached over HTTPS.
    owners = {scheduler_get(cluster, f"/bindings/{i}")["nodeID"] for i in ids}
    assert owners == {"node-0", "node-1"}
    for index, flow in enumerate(flows):
        envd = f"https://49983-{flow['sandbox_id']}.{cluster.domain}"
        assert flow["envd_url"] == envd
        assert flow["echo"] == f"node says {index}\n"
        assert flow["blob"] is True
        assert flow["download_url"].startswith(f"{envd}/files?")
        assert flow["download"] == [200, f"signed {index}"]
        assert flow["pty_exit"] == 0 and "24 80" in flow["pty"] and "pty-42" in flow["pty"]
        assert flow["host"] == f"8080-{flow['sandbox_id']}.{cluster.domain}"
        assert flow["port"] == [200, f"port {index}"]
    assert set(ids) <= set(seen["listed"])
    assert seen["reconnected"] == "again\n"
    with httpx.Client(
        base_url=cluster.gateway_url,
        headers={"X-API-Key": cluster.api_key},
        verify=cluster.verify(),
        trust_env=False,
        timeout=120,
    ) as gateway:
        for sandbox_id in ids:
            assert gateway.delete(f"/sandboxes/{sandbox_id}").status_code == 204
