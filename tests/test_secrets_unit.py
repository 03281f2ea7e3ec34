"""Secrets without VMs: the cipher and its key file, the secrets API over a real posix
repository shared by two nodes (the fakes of :mod:`tests.fakes`), network ``rules``
parsing, and the filter's rewriting of a request head. That a value never leaves the
server is checked on every answer here; ``tests/e2b/test_sdk_secrets.py`` drives the
same through the SDK and a real guest."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.api.app import create_app
from agentenv.network.egress_filter import rewrite_request_head
from agentenv.network.policy import EgressPolicy, PolicyError, render_header_value
from agentenv.orchestrator.errors import SecretNotFound
from agentenv.orchestrator.records import SecretEntry
from agentenv.orchestrator.secrets import SecretCipher, SecretKeyMismatch
from tests.fakes import FAKE_TEMPLATE, Node, in_process_client, start_node

API_KEY = "e2b_" + "ef" * 20
VALUE = "sk-live-0123456789abcdef-never-shown"

needs_qemu_img = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="disk overlays need qemu-img (qemu-utils)"
)


# -- the cipher ----------------------------------------------------------------------------
def _entry(cipher: SecretCipher, secret_id: str, version: int, value: str) -> SecretEntry:
    nonce, ciphertext = cipher.seal(secret_id, version, value)
    return SecretEntry(
        id=secret_id,
        name="k",
        current_version=version,
        created_at="2026-01-01T00:00:00Z",  # type: ignore[arg-type]
        updated_at="2026-01-01T00:00:00Z",  # type: ignore[arg-type]
        key_id=cipher.key_id,
        nonce=nonce,
        ciphertext=ciphertext,
    )


def test_key_file_is_made_once_and_private(tmp_path: Path) -> None:
    path = tmp_path / "home" / "secrets.key"
    first = SecretCipher.load(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = SecretCipher.load(path)
    assert again.key_id == first.key_id
    entry = _entry(first, "sec_" + "a" * 24, 1, VALUE)
    assert again.open(entry) == VALUE
    assert VALUE not in entry.model_dump_json()


def test_ciphertext_is_bound_to_its_key_secret_and_version(tmp_path: Path) -> None:
    cipher = SecretCipher(b"k" * 32)
    entry = _entry(cipher, "sec_" + "a" * 24, 2, VALUE)
    assert cipher.open(entry) == VALUE
    with pytest.raises(SecretKeyMismatch, match="another key"):
        SecretCipher(b"x" * 32).open(entry)
    # Moved onto another secret or version, or altered: it does not decrypt.
    for change in (
        {"id": "sec_" + "b" * 24},
        {"current_version": 3},
        {"ciphertext": _entry(cipher, "sec_" + "a" * 24, 2, "other").ciphertext},
    ):
        with pytest.raises(SecretKeyMismatch, match="does not decrypt"):
            cipher.open(entry.model_copy(update=change))


# -- the API, over a repository two nodes share ---------------------------------------------
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


def _no_value(response: httpx.Response) -> None:
    assert VALUE not in response.text
    assert all(VALUE not in value for value in response.headers.values())


@needs_qemu_img
async def test_secrets_api(api: httpx.AsyncClient, node: Node, tmp_path: Path) -> None:
    created = await api.post(
        "/secrets", json={"name": "OpenAI-Key", "value": VALUE, "metadata": {"team": "a"}}
    )
    assert created.status_code == 201, created.text
    _no_value(created)
    info = created.json()
    assert info["name"] == "openai-key" and info["currentVersion"] == 1
    assert info["secretID"].startswith("sec_") and info["metadata"] == {"team": "a"}
    assert set(info) == {"secretID", "name", "currentVersion", "metadata", "createdAt", "updatedAt"}

    # By id or name, in any case.
    for key in (info["secretID"], "openai-key", "OPENAI-KEY"):
        got = await api.get(f"/secrets/{key}")
        assert got.status_code == 200 and got.json() == info
        _no_value(got)
    taken = await api.post("/secrets", json={"name": "openai-key", "value": "x"})
    assert taken.status_code == 409, taken.text

    updated = await api.post(f"/secrets/{info['secretID']}", json={"value": VALUE + "2"})
    assert updated.status_code == 200, updated.text
    _no_value(updated)
    assert updated.json()["currentVersion"] == 2
    assert updated.json()["metadata"] == {"team": "a"}  # kept when not given
    replaced = await api.post("/secrets/openai-key", json={"value": VALUE, "metadata": {}})
    assert replaced.json()["currentVersion"] == 3 and replaced.json()["metadata"] == {}
    assert await node.orchestrator.secrets.value("openai-key") == VALUE

    # Paging, by name.
    for name in ("b", "c", "d"):
        assert (await api.post("/secrets", json={"name": name, "value": VALUE})).status_code == 201
    names, token = [], None
    while True:
        params: dict[str, Any] = {"limit": 3, **({"nextToken": token} if token else {})}
        page = await api.get("/secrets", params=params)
        assert page.status_code == 200
        _no_value(page)
        names += [item["name"] for item in page.json()]
        token = page.headers.get("x-next-token")
        if not token:
            break
    assert names == ["b", "c", "d", "openai-key"]

    # The key was made at start, private; the repository holds no value in the clear,
    # and no key.
    assert stat.S_IMODE(os.stat(node.config.home / "secrets.key").st_mode) == 0o600
    repository = tmp_path / "repository"
    stored = b"".join(p.read_bytes() for p in repository.rglob("*") if p.is_file())
    assert b"secret:openai-key" in stored or b"secret%3Aopenai-key" in b"".join(
        str(p).encode() for p in repository.rglob("*")
    )
    assert VALUE.encode() not in stored
    key = (node.config.home / "secrets.key").read_text().strip()
    assert key.encode() not in stored

    assert (await api.delete("/secrets/openai-key")).status_code == 204
    assert (await api.get("/secrets/openai-key")).status_code == 404
    assert (await api.delete("/secrets/openai-key")).status_code == 404
    with pytest.raises(SecretNotFound):
        await node.orchestrator.secrets.value("openai-key")
    # The name is free again.
    again = await api.post("/secrets", json={"name": "openai-key", "value": "v"})
    assert again.status_code == 201


@needs_qemu_img
@pytest.mark.parametrize(
    ("method", "path", "body", "status", "named"),
    [
        ("get", "/secrets/nope", None, 404, "nope"),
        ("get", "/secrets/sec_" + "0" * 24, None, 404, "sec_"),
        ("post", "/secrets/nope", {"value": "v"}, 404, "nope"),
        ("delete", "/secrets/nope", None, 404, "nope"),
        ("post", "/secrets", {"name": "a b", "value": "v"}, 400, "secret name"),
        ("post", "/secrets", {"name": "sec_x", "value": "v"}, 400, "reserved"),
        ("post", "/secrets", {"name": "ok", "value": ""}, 400, "value"),
        ("post", "/secrets", {"name": "ok", "value": "a\r\nb"}, 400, "line breaks"),
        ("post", "/secrets", {"name": "ok"}, 400, "value"),
        ("post", "/secrets", {"name": "ok", "value": "v", "extra": 1}, 400, "extra"),
        ("post", "/secrets", {"name": "ok", "value": "v", "metadata": {"k": 1}}, 400, "metadata"),
        (
            "post",
            "/secrets",
            {"name": "ok", "value": "v", "metadata": {str(i): "v" for i in range(33)}},
            400,
            "metadata",
        ),
        ("get", "/secrets?nextToken=%%%", None, 400, "nextToken"),
        ("get", "/secrets?limit=0", None, 400, "limit"),
    ],
)
async def test_bad_requests_are_clear(
    api: httpx.AsyncClient,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    status: int,
    named: str,
) -> None:
    answer = await api.request(method, path, json=body)
    assert answer.status_code == status, answer.text
    assert named in answer.json()["message"]
    assert (await api.get("/secrets", headers={"X-API-Key": "wrong"})).status_code == 401


@needs_qemu_img
@pytest.mark.parametrize(
    "body",
    [
        b'{"name": "ok", "value": "\\ud800"}',
        b'{"name": "ok", "value": "v", "metadata": {"k": "\\udfff"}}',
    ],
)
async def test_text_that_is_not_unicode_is_a_400(api: httpx.AsyncClient, body: bytes) -> None:
    answer = await api.post("/secrets", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and "Unicode" in answer.json()["message"], answer.text


@needs_qemu_img
async def test_another_node_resolves_with_the_same_key_only(node: Node, tmp_path: Path) -> None:
    await node.orchestrator.secrets.create("shared", VALUE, {})
    key = (node.config.home / "secrets.key").read_text().strip()
    same = await start_node(
        tmp_path / "b",
        tmp_path / "repository",
        node_id="node-b",
        configure=lambda c: c.model_copy(update={"secrets_key": key}),
    )
    other = await start_node(tmp_path / "c", tmp_path / "repository", node_id="node-c")
    try:
        assert await same.orchestrator.secrets.value("shared") == VALUE
        assert (await other.orchestrator.secrets.find("shared")).current_version == 1
        with pytest.raises(SecretKeyMismatch, match="same key"):
            await other.orchestrator.secrets.value("shared")
    finally:
        await same.stop()
        await other.stop()


# -- network rules -------------------------------------------------------------------------
def _rules(headers: dict[str, str], host: str = "api.example.com") -> dict[str, Any]:
    return {host: [{"transform": {"headers": headers}}]}


def test_rules_parse_and_round_trip() -> None:
    policy = EgressPolicy.parse(
        allow_internet=False,
        allow_out=["api.example.com", "*.wild.example", "203.0.113.0/24"],
        rules={
            "api.example.com": [
                {"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.Key-1}"}}},
                {},
            ],
            "*.x.wild.example": [{"transform": {"headers": {"X-Team": "a"}}}],
            "203.0.113.7": [{"transform": {"headers": {"X-Key": "${e2b.secrets.k2}"}}}],
        },
    )
    assert policy.needs_filter and policy.secret_names == ("Key-1", "k2")
    assert EgressPolicy.from_dict(policy.to_dict()) == policy
    assert policy.rules_dict()["203.0.113.7"] == [
        {"transform": {"headers": {"X-Key": "${e2b.secrets.k2}"}}}
    ]
    # Rules alone (a network one) need the filter, not host-name DNS.
    only_network = EgressPolicy.parse(
        allow_internet=False, allow_out=["203.0.113.7"], rules=_rules({"X": "y"}, "203.0.113.7")
    )
    assert only_network.needs_filter and not only_network.has_hostname_rules
    assert "rules" not in EgressPolicy(allow_internet=True).to_dict()


@pytest.mark.parametrize(
    ("allow_out", "rules", "named"),
    [
        ([], _rules({"X": "y"}), "must also be allowed by allowOut"),
        (["203.0.113.0/24"], _rules({"X": "y"}), "must also be allowed"),
        (["api.example.com"], _rules({"X": "y"}, "203.0.113.7"), "must also be allowed"),
        (["*.example.com"], _rules({"X": "y"}, "example.com"), "must also be allowed"),
        (["api.example.com"], _rules({"Host": "evil"}), "cannot be set"),
        (["api.example.com"], _rules({"Content-Length": "1"}), "cannot be set"),
        (["api.example.com"], _rules({"Bad Name": "v"}), "not a header name"),
        (["api.example.com"], _rules({"X": "a\r\nInjected: 1"}), "control characters"),
        (["api.example.com"], _rules({"X": "${e2b.identity.tokens.aws}"}), "identity"),
        (["api.example.com"], _rules({"X": "${e2b.other.x}"}), "not a secret placeholder"),
        (["api.example.com"], {"api.example.com": {"transform": {}}}, "list of rules"),
        (["api.example.com"], {"api.example.com": [{"transform": {"body": 1}}]}, "only 'headers'"),
        (["api.example.com"], ["api.example.com"], "must map"),
        (["api.example.com"], _rules({"X": "y"}, "::1"), "IPv6"),
    ],
)
def test_bad_rules_are_refused(allow_out: list[str], rules: Any, named: str) -> None:
    with pytest.raises(PolicyError) as caught:
        EgressPolicy.parse(allow_internet=True, allow_out=allow_out, rules=rules)
    assert caught.value.field == "rules" and named in str(caught.value)


async def test_placeholders_render_with_the_lookup() -> None:
    async def lookup(name: str) -> str:
        return {"a": "1", "b": "2"}[name]

    rendered = await render_header_value("x ${e2b.secrets.a}-${e2b.secrets.b} $b", lookup)
    assert rendered == "x 1-2 $b"


def test_request_head_rewrite() -> None:
    head = (
        b"POST /v1/x?q=1 HTTP/1.1\r\nHost: api.example.com\r\nauthorization: guest\r\n"
        b"Connection: keep-alive\r\nContent-Length: 4\r\n\r\nbody"
    )
    out = rewrite_request_head(head, [("Authorization", "Bearer s"), ("X-New", "n")])
    assert out is not None
    lines = out.split(b"\r\n")
    assert lines[0] == b"POST /v1/x?q=1 HTTP/1.1"
    assert b"authorization: guest" not in out and b"keep-alive" not in out
    assert b"Authorization: Bearer s" in lines and b"X-New: n" in lines
    assert b"Connection: close" in lines and b"Content-Length: 4" in lines
    assert out.endswith(b"\r\n\r\nbody")
    assert rewrite_request_head(b"GET / HTTP/1.1\r\nHost: a\r\n", []) is None
    assert rewrite_request_head(b"\x16\x03\x01 not http\r\n\r\n", []) is None


@needs_qemu_img
async def test_create_with_rules_checks_secrets_and_shows_only_placeholders(
    api: httpx.AsyncClient, node: Node
) -> None:
    network = {
        "allowOut": ["api.example.com"],
        "rules": _rules({"Authorization": "Bearer ${e2b.secrets.tok}"}),
    }
    body = {"templateID": FAKE_TEMPLATE, "network": network}
    unknown = await api.post("/v2/sandboxes", json=body)
    assert unknown.status_code == 400 and "tok" in unknown.json()["message"]
    await node.orchestrator.secrets.create("tok", VALUE, {})
    created = await api.post("/v2/sandboxes", json=body)
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["sandboxID"]
    detail = await api.get(f"/sandboxes/{sandbox_id}")
    _no_value(detail)
    assert detail.json()["network"]["rules"] == network["rules"]
    rec = node.orchestrator.store.get_sandbox(sandbox_id)
    assert rec is not None
    assert node.network.policies[rec.slot].secret_names == ("tok",)
    # Updates are checked the same way.
    url = f"/sandboxes/{sandbox_id}/network"
    bad = dict(network, rules=_rules({"X": "${e2b.secrets.missing}"}))
    assert (await api.put(url, json=bad)).status_code == 400
    assert node.network.policies[rec.slot].secret_names == ("tok",)
