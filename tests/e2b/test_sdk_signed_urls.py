"""Signed download and upload URLs (``download_url`` / ``upload_url``) made by the official
SDK through ``E2B_SANDBOX_URL``, used as a browser or curl would: no headers, so the URL
names no sandbox and the server finds it by the signature (``agentenv.proxy.signed``).
The https ``{port}-{id}.{domain}`` form is in ``test_sdk_tls``."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterator

import httpx
import pytest
from e2b import E2B, Sandbox

from tests.helpers import ServerProcess

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def sbx(e2b: E2B) -> Iterator[Sandbox]:
    sandbox = e2b.Sandbox.create(timeout=600, metadata={"suite": "e2b-signed-urls"})
    yield sandbox
    sandbox.kill()


def with_query(url: str, **changes: str) -> str:
    """``url`` with some query parameters replaced."""
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    query.update(changes)
    return parts._replace(query=urllib.parse.urlencode(query)).geturl()


def upload(url: str, data: bytes) -> httpx.Response:
    return httpx.post(url, files={"file": ("upload.bin", data)}, trust_env=False)


def test_signed_urls_sync(sbx: Sandbox, e2b_server: ServerProcess) -> None:
    sbx.files.write("/home/user/signed/data.txt", "hello signed")
    url = sbx.download_url("/home/user/signed/data.txt", use_signature_expiration=120)
    # What SDK 2.63 builds with E2B_SANDBOX_URL: the shared URL, no sandbox in it.
    assert url.startswith(f"{e2b_server.url}/files?path=")
    assert sbx.sandbox_id not in url and "signature_expiration=" in url
    got = httpx.get(url, trust_env=False)
    assert (got.status_code, got.text) == (200, "hello signed")
    # Signed without an expiry, and for another user.
    assert httpx.get(sbx.download_url("/home/user/signed/data.txt")).text == "hello signed"
    sbx.commands.run("echo root-only > /root/r.txt && chmod 600 /root/r.txt", user="root")
    as_root = sbx.download_url("/root/r.txt", user="root", use_signature_expiration=120)
    assert httpx.get(as_root).text == "root-only\n"

    payload = bytes(range(256)) * 64
    sent = upload(sbx.upload_url("/home/user/signed/up.bin", use_signature_expiration=120), payload)
    assert sent.status_code == 200, sent.text
    assert bytes(sbx.files.read("/home/user/signed/up.bin", format="bytes")) == payload
    assert sbx.commands.run("stat -c %U /home/user/signed/up.bin").stdout == "user\n"
    sent = upload(sbx.upload_url("/root/up.txt", user="root"), b"by root")
    assert sent.status_code == 200, sent.text
    assert sbx.commands.run("stat -c %U /root/up.txt", user="root").stdout == "root\n"


def test_bad_signed_urls(sbx: Sandbox, e2b_server: ServerProcess) -> None:
    sbx.files.write("/home/user/signed/bad.txt", "x")
    url = sbx.download_url("/home/user/signed/bad.txt", use_signature_expiration=120)
    signature = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))["signature"]
    flipped = signature[:-1] + ("A" if signature[-1] != "A" else "B")
    refused = {
        "tampered signature": with_query(url, signature=flipped),
        "another path": with_query(url, path="/home/user/signed/other.txt"),
        "another user": with_query(url, username="root"),
        "a later expiry": with_query(url, signature_expiration=str(int(time.time()) + 9999)),
        "a malformed expiry": with_query(url, signature_expiration="soon"),
    }
    for what, bad in refused.items():
        answer = httpx.get(bad, trust_env=False)
        assert answer.status_code == 401, (what, answer.text)
    # An upload URL does not download, nor a download URL upload.
    up = sbx.upload_url("/home/user/signed/bad.txt", use_signature_expiration=120)
    assert httpx.get(up).status_code == 401
    assert upload(url, b"overwritten").status_code == 401
    assert sbx.files.read("/home/user/signed/bad.txt") == "x"

    short = sbx.download_url("/home/user/signed/bad.txt", use_signature_expiration=1)
    time.sleep(2.5)
    expired = httpx.get(short, trust_env=False)
    assert expired.status_code == 401 and "expired" in expired.json()["message"]

    # No sandbox header, no host name and no signature: nothing says which sandbox.
    unsigned = httpx.get(f"{e2b_server.url}/files", params={"path": "/etc/hostname"})
    assert unsigned.status_code == 400 and "names no sandbox" in unsigned.json()["message"]


def test_sdk_debug_mode_urls_are_unsigned(e2b_server: ServerProcess) -> None:
    """Debug mode never asks the control plane: its sandbox is ``debug_sandbox_id`` with
    no access token, at ``localhost:49983``. Its URLs carry no signature, so there is no
    sandbox to route them to: a clear 400, not a file of some sandbox."""
    debug = Sandbox.create(debug=True, api_key=e2b_server.api_key)
    url = debug.download_url("/etc/hostname")
    assert url == "http://localhost:49983/files?path=%2Fetc%2Fhostname"
    path_and_query = url.removeprefix("http://localhost:49983")
    answer = httpx.get(f"{e2b_server.url}{path_and_query}", headers={"host": "localhost:49983"})
    assert answer.status_code == 400


async def test_signed_urls_async_and_per_sandbox(
    e2b: E2B, sbx: Sandbox, e2b_server: ServerProcess
) -> None:
    other = await e2b.AsyncSandbox.create(timeout=300, metadata={"suite": "e2b-signed-urls"})
    try:
        # The same path in two sandboxes: each URL reaches the sandbox that signed it.
        await other.files.write("/home/user/same.txt", "async sandbox")
        sbx.files.write("/home/user/same.txt", "sync sandbox")
        async with httpx.AsyncClient(trust_env=False) as client:
            mine = other.download_url("/home/user/same.txt", use_signature_expiration=60)
            theirs = sbx.download_url("/home/user/same.txt", use_signature_expiration=60)
            assert mine.startswith(f"{e2b_server.url}/files?")
            assert (await client.get(mine)).text == "async sandbox"
            assert (await client.get(theirs)).text == "sync sandbox"

            target = other.upload_url("/home/user/async-up.txt", use_signature_expiration=60)
            sent = await client.post(target, files={"file": ("a", b"async upload")})
            assert sent.status_code == 200, sent.text
            assert await other.files.read("/home/user/async-up.txt") == "async upload"
            assert not sbx.files.exists("/home/user/async-up.txt")

            # A killed sandbox's URLs lead nowhere.
            await other.kill()
            gone = await client.get(mine)
            assert gone.status_code == 401, gone.text
    finally:
        await other.kill()
