"""The TLS edge: a server with ``AENV_TLS_CERT`` / ``AENV_TLS_KEY`` (a wildcard certificate
from a throw-away CA) serves the API at ``https://api.{domain}`` and sandbox ports at
``https://{port}-{id}.{domain}``, so the unmodified SDK works with ``E2B_DOMAIN`` alone,
sync and async, signed file URLs included (``tls_client`` runs the SDK)."""

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

from tests.helpers import ServerProcess, free_port, live_server
from tests.local_ca import make_local_ca

pytestmark = pytest.mark.vm

# *.localhost resolves to the loopback address without DNS (RFC 6761) in the SDK's
# resolver; the wildcard needs a label under it (no certificate is valid for *.localhost).
DOMAIN = "aenv.localhost"


@pytest.fixture(scope="module")
def tls_server(test_root: Path, guest_image: None) -> Iterator[ServerProcess]:
    port = free_port()
    ca = make_local_ca(test_root / "tls-ca", DOMAIN)
    srv = ServerProcess(
        home=test_root / "tls",
        port=port,
        ca_file=ca.ca_cert,
        extra_env={
            "AENV_DOMAIN": f"{DOMAIN}:{port}",
            "AENV_TLS_CERT": str(ca.server_cert),
            "AENV_TLS_KEY": str(ca.server_key),
        },
    )
    with live_server(srv):
        yield srv


def run_sdk(server: ServerProcess) -> dict[str, Any]:
    assert server.ca_file is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "SSL_CERT_"))}
    env.update(
        E2B_DOMAIN=f"{DOMAIN}:{server.port}",
        E2B_API_KEY=server.api_key,
        SSL_CERT_FILE=str(server.ca_file),
    )
    script = Path(__file__).with_name("tls_client.py")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_sdk_with_e2b_domain_only(tls_server: ServerProcess) -> None:
    seen = run_sdk(tls_server)
    domain = f"{DOMAIN}:{tls_server.port}"
    sync, asynchronous = seen["sync"], seen["async"]
    for flow, text in ((sync, "over tls"), (asynchronous, "async over tls")):
        envd = f"https://49983-{flow['sandbox_id']}.{domain}"
        assert flow["envd_url"] == envd
        assert flow["read"] == text
        assert flow["download_url"].startswith(f"{envd}/files?path=")
        assert flow["download"] == [200, text]
        assert flow["upload"] == 200
    assert sync["listed"] is True
    assert sync["uploaded"] == "uploaded over tls"
    assert asynchronous["uploaded"] == "async upload"
    assert sync["tampered"] == 401
    assert sync["host"] == f"8080-{sync['sandbox_id']}.{domain}"
    assert sync["port"] == [200, "port over tls"]
    # base has what E2B's base image has.
    tools = sync["tools"]
    for expected in ("Python 3.", "pip ", "git version", "curl", "sudo ok", "jq-", "venv ok"):
        assert expected in tools, tools
    assert asynchronous["python"] == "42\n"


def test_plain_http_and_untrusted_clients_are_refused(tls_server: ServerProcess) -> None:
    # The server speaks only TLS on its port...
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{tls_server.port}/health", trust_env=False, timeout=10)
    # ...with the configured certificate, which a client without the CA does not trust.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{tls_server.url}/health", trust_env=False, timeout=10)
    assert httpx.get(f"{tls_server.url}/health", verify=tls_server.verify).status_code == 200
