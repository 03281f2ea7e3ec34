"""The SDK's ``Secret`` and ``AsyncSecret`` against the server, and a secret used the way
E2B uses it: in a network ``rules`` header that a request from a real guest gets on
the host, while the guest (its environment, its files, every API answer) never holds
the value."""

from __future__ import annotations

import contextlib
import secrets
import socket
import sqlite3
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import (
    E2B,
    AsyncSecret,
    InvalidArgumentException,
    Sandbox,
    Secret,
    SecretException,
    SecretNotFoundException,
)
from pyroute2 import netns

from agentenv.config import Config
from agentenv.network.addresses import GUEST_GATEWAY
from tests.e2b.support import sdk_opts
from tests.helpers import ServerProcess
from tests.local_ca import make_local_ca

VALUE = "sk-e2b-secret-" + secrets.token_hex(12)


def _no_value(server: ServerProcess, *paths: str) -> None:
    with server.client() as client:
        for path in paths:
            answer = client.get(path)
            assert answer.status_code == 200, answer.text
            assert VALUE not in answer.text


def test_secret_lifecycle_sync(e2b: E2B, e2b_server: ServerProcess) -> None:
    name = "sync-" + secrets.token_hex(4)
    info = e2b.Secret.create(name, VALUE, metadata={"owner": "tests"})
    assert info.name == name and info.version == 1 and info.metadata == {"owner": "tests"}
    assert info.secret_id.startswith("sec_") and info.created_at == info.updated_at
    assert e2b.Secret.exists(name) and e2b.Secret.exists(info.secret_id)
    assert e2b.Secret.get_info(info.secret_id) == info

    updated = e2b.Secret.update(name, VALUE + "-2")
    assert updated.version == 2 and updated.metadata == {"owner": "tests"}
    assert updated.updated_at > info.updated_at
    assert e2b.Secret.update(name, VALUE, metadata={}).metadata == {}

    listed = []
    paginator = e2b.Secret.list(limit=1)
    while paginator.has_next:
        listed += paginator.next_items()
    assert name in [item.name for item in listed]
    _no_value(e2b_server, "/secrets", f"/secrets/{name}")

    with pytest.raises(SecretException, match="exists"):
        e2b.Secret.create(name, "other")
    assert e2b.Secret.destroy(name) is True
    assert e2b.Secret.destroy(name) is False
    assert not e2b.Secret.exists(name)
    with pytest.raises(SecretNotFoundException):
        e2b.Secret.get_info(name)
    with pytest.raises(SecretNotFoundException):
        e2b.Secret.update(name, "v")
    with pytest.raises(SecretException, match="secret name"):
        e2b.Secret.create("no spaces allowed", "v")
    with pytest.raises(InvalidArgumentException):
        Secret.fill("bad{name}")


async def test_secret_lifecycle_async(e2b_server: ServerProcess) -> None:
    opts = sdk_opts(e2b_server)
    name = "async-" + secrets.token_hex(4)
    info = await AsyncSecret.create(name, VALUE, **opts)
    assert info.version == 1 and info.metadata == {}
    assert await AsyncSecret.exists(name, **opts)
    assert (await AsyncSecret.get_info(name.upper(), **opts)).secret_id == info.secret_id
    assert (await AsyncSecret.update(info.secret_id, VALUE, **opts)).version == 2
    paginator = AsyncSecret.list(**opts)
    names = []
    while paginator.has_next:
        names += [item.name for item in await paginator.next_items()]
    assert name in names
    assert await AsyncSecret.destroy(name, **opts) is True
    assert not await AsyncSecret.exists(name, **opts)
    with pytest.raises(SecretNotFoundException):
        await AsyncSecret.update(name, "v", **opts)
    assert await AsyncSecret.destroy(name, **opts) is False


# -- in a network rule, with a real guest ---------------------------------------------------
#
# This host refuses sandboxes its own services and has nowhere else a guest could reach,
# so the web server listens in the sandbox's own network namespace (on the host side, out
# of the guest's reach), on the guest's gateway address, which ``allow_out`` opens: the
# guest's request to it goes through the server's egress filter like any other.


def _netns_of(server: ServerProcess, sandbox_id: str) -> str:
    config = Config.load(env={}, home=server.home)
    with contextlib.closing(
        sqlite3.connect(f"file:{config.home / 'state.db'}?mode=ro", uri=True)
    ) as db:
        (slot,) = db.execute(
            "SELECT slot FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,)
        ).fetchone()
    return f"ae{config.instance_tag}-{slot}"


@contextlib.contextmanager
def _recording_server(
    namespace: str, port: int = 80, tls: ssl.SSLContext | None = None
) -> Iterator[list[bytes]]:
    """An HTTP server (HTTPS with ``tls``) on ``GUEST_GATEWAY:port`` in `namespace`;
    yields the request heads it received."""
    listener = netns.create_socket(namespace, socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((GUEST_GATEWAY, port))
    listener.listen(8)
    heads: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if tls is not None:
                conn.settimeout(10)
                try:
                    conn = tls.wrap_socket(conn, server_side=True)
                except OSError:
                    conn.close()
                    continue  # a handshake that failed: serve the next one
            with conn:
                conn.settimeout(10)
                data = b""
                with contextlib.suppress(OSError):
                    while b"\r\n\r\n" not in data and (chunk := conn.recv(4096)):
                        data += chunk
                    heads.append(data)
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nrecorded"
                    )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield heads
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)


def _authorization(heads: list[bytes]) -> list[str]:
    return [
        line.split(b":", 1)[1].strip().decode()
        for head in heads
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"authorization:")
    ]


GUEST_REQUEST = """
import ssl, sys, urllib.request
request = urllib.request.Request(sys.argv[1], headers={"Authorization": "guest-made"})
# The HTTPS case's server has a throw-away certificate the guest has no reason to trust.
context = ssl._create_unverified_context()
print(urllib.request.urlopen(request, timeout=20, context=context).read().decode())
"""


def _sandbox_with_a_secret_rule(e2b: E2B, prefix: str) -> tuple[str, Sandbox]:
    """A new secret (its name starts with ``prefix``) and a sandbox whose only way out is
    the host at the guest's gateway, with a rule adding ``Authorization: Bearer`` and
    that secret to what it sends there."""
    name = prefix + secrets.token_hex(4)
    e2b.Secret.create(name, VALUE)
    header = {"Authorization": f"Bearer {Secret.fill(name)}"}
    sbx = e2b.Sandbox.create(
        timeout=180,
        allow_internet_access=False,
        network={
            "allow_out": [GUEST_GATEWAY],
            "rules": {GUEST_GATEWAY: [{"transform": {"headers": header}}]},
        },
    )
    return name, sbx


@pytest.mark.vm
def test_rule_header_reaches_the_server_but_never_the_guest(
    e2b: E2B, e2b_server: ServerProcess
) -> None:
    name, sbx = _sandbox_with_a_secret_rule(e2b, "rule-")
    url = f"http://{GUEST_GATEWAY}/probe"
    try:
        sbx.files.write("/tmp/fetch.py", GUEST_REQUEST)
        with _recording_server(_netns_of(e2b_server, sbx.sandbox_id)) as heads:
            result = sbx.commands.run(f"python3 /tmp/fetch.py {url}", timeout=60)
            assert result.stdout.strip() == "recorded"
            # The guest's own Authorization was replaced.
            assert _authorization(heads) == [f"Bearer {VALUE}"]

            # The value is in no API answer and nowhere in the guest.
            _no_value(e2b_server, f"/sandboxes/{sbx.sandbox_id}", "/v2/sandboxes", "/secrets")
            assert VALUE not in sbx.commands.run("env").stdout
            search = sbx.commands.run(
                f"grep -rsl -- {VALUE} /etc /home /root /tmp /run /var /opt /proc/cmdline; true",
                timeout=120,
            )
            assert search.stdout.strip() == ""
            assert VALUE not in repr(sbx.get_info())

            # An update of the secret applies to the next request at once.
            e2b.Secret.update(name, VALUE + "-rotated")
            heads.clear()
            sbx.commands.run(f"python3 /tmp/fetch.py {url}", timeout=60)
            assert _authorization(heads) == [f"Bearer {VALUE}-rotated"]
            # Destroyed, the request is refused before it is sent anywhere.
            e2b.Secret.destroy(name)
            heads.clear()
            refused = sbx.commands.run(
                f"python3 /tmp/fetch.py {url} 2>&1 || echo refused", timeout=60
            )
            assert "refused" in refused.stdout and heads == []
    finally:
        sbx.kill()

    # A rules header naming a missing secret is refused up front.
    body = {
        "templateID": "base",
        "network": {
            "allowOut": [GUEST_GATEWAY],
            "rules": {GUEST_GATEWAY: [{"transform": {"headers": {"X": Secret.fill("missing")}}}]},
        },
    }
    with e2b_server.client() as client:
        refused_create = client.post("/v2/sandboxes", json=body)
    assert refused_create.status_code == 400 and "missing" in refused_create.text


@pytest.mark.vm
def test_rule_headers_are_not_added_to_https(
    e2b: E2B, e2b_server: ServerProcess, tmp_path: Path
) -> None:
    """HTTPS to a rule's host is relayed untouched: no TLS interception, so the rule's
    headers are not added (the README says so), the guest's own request arrives as it
    sent it, and the secret is in nothing that leaves."""
    name, sbx = _sandbox_with_a_secret_rule(e2b, "tls-")
    ca = make_local_ca(tmp_path / "ca", "rule.test")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(ca.server_cert, ca.server_key)
    try:
        sbx.files.write("/tmp/fetch.py", GUEST_REQUEST)
        namespace = _netns_of(e2b_server, sbx.sandbox_id)
        with _recording_server(namespace, 443, tls) as heads:
            result = sbx.commands.run(
                f"python3 /tmp/fetch.py https://{GUEST_GATEWAY}/probe", timeout=60
            )
            assert result.stdout.strip() == "recorded"
            assert _authorization(heads) == ["guest-made"]
            assert all(VALUE.encode() not in head for head in heads)
    finally:
        sbx.kill()
        e2b.Secret.destroy(name)
