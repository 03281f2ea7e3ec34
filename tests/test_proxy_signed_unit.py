"""Finding the sandbox a signed ``/files`` URL was made for (``agentenv.proxy.signed``),
with signatures made the SDK's way (``e2b.sandbox.signature``), and the gateway's question
to its nodes (``agentenv.cluster.signed_files``) against fake nodes."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

import httpx
import pytest
from e2b.sandbox.signature import get_signature

from agentenv.cluster.models import NodeInfo
from agentenv.cluster.signed_files import signer_node
from agentenv.proxy.relay import Refusal
from agentenv.proxy.signed import (
    SIGNER_PATH,
    FilesNotRouted,
    signed_files_sandbox,
    signer_query,
)

TOKENS = [("sbx-a", "token-a"), ("sbx-b", "token-b"), ("sbx-open", None)]


def scope(method: str, path: str, params: dict[str, str]) -> dict[str, Any]:
    query = urllib.parse.urlencode(params, quote_via=urllib.parse.quote).encode()
    return {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
    }


def signed(
    path: str,
    operation: str,
    token: str,
    user: str | None = None,
    expires: int | None = 24 * 3600,
) -> dict[str, str]:
    """The query the SDK's download_url/upload_url builds. Parametrized cases are built
    when the tests are collected, maybe long before they run: they expire in a day."""
    made = get_signature(path, operation, user, token, expires)  # type: ignore[arg-type]
    params = {"path": path, "signature": made["signature"]}
    if user:
        params["username"] = user
    if made["expiration"] is not None:
        params["signature_expiration"] = str(made["expiration"])
    return params


def route(method: str, params: dict[str, str], path: str = "/files") -> str | None:
    return signed_files_sandbox(scope(method, path, params), lambda: TOKENS)


def test_the_signer_is_found() -> None:
    assert route("GET", signed("/a.txt", "read", "token-b")) == "sbx-b"
    assert route("HEAD", signed("/a.txt", "read", "token-a", expires=None)) == "sbx-a"
    assert route("POST", signed("/up", "write", "token-a", user="root")) == "sbx-a"


@pytest.mark.parametrize(
    ("method", "params", "status", "message"),
    [
        ("GET", signed("/a", "write", "token-a"), 401, "invalid signature"),  # an upload URL
        ("POST", signed("/a", "read", "token-a"), 401, "invalid signature"),
        ("GET", {**signed("/a", "read", "token-a"), "path": "/b"}, 401, "invalid signature"),
        ("GET", {**signed("/a", "read", "token-a"), "username": "root"}, 401, "invalid"),
        ("GET", signed("/a", "read", "other-token"), 401, "invalid signature"),
        (
            "GET",
            {**signed("/a", "read", "token-a"), "signature_expiration": "x"},
            401,
            "expiration",
        ),
        ("GET", signed("/a", "read", "token-a", expires=-5), 401, "expired"),
        ("GET", {"path": "/a"}, 400, "names no sandbox"),
        ("GET", {"path": "/a", "signature": ""}, 400, "names no sandbox"),
    ],
)
def test_bad_urls_are_refused(
    method: str, params: dict[str, str], status: int, message: str
) -> None:
    with pytest.raises(FilesNotRouted, match=message) as refused:
        route(method, params)
    assert refused.value.status == status


def test_other_paths_are_the_control_planes() -> None:
    good = signed("/a", "read", "token-a")
    for path in ("/files/", "/files/x", "/sandboxes", "/files/../files", "/x/../files"):
        assert route("GET", good, path=path) is None, path


def test_signer_query_method_wins() -> None:
    query = urllib.parse.urlencode({"path": "/a", "method": "GET"}).encode()
    probe = urllib.parse.parse_qs(signer_query(query, "POST").decode())
    assert probe["method"][-1] == "POST" and probe["path"] == ["/a"]
    assert signer_query(b"", "GET") == b"method=GET"


def node(node_id: str) -> NodeInfo:
    report = {"nodeID": node_id, "url": f"http://{node_id}", "cpuCount": 2, "memoryMib": 1024}
    return NodeInfo.model_validate(
        {
            "state": "up",
            "lastSeen": "2026-01-01T00:00:00Z",
            "report": {**report, "allocatedVcpus": 0, "allocatedMemoryMib": 0},
        }
    )


async def test_gateway_asks_every_node() -> None:
    holders = {"node-1": "token-b"}
    silent: set[str] = set()
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        node_id = request.url.host
        asked.append(node_id)
        assert request.url.path == SIGNER_PATH
        if node_id in silent:
            raise httpx.ConnectError("down", request=request)
        tokens = [(node_id, holders[node_id])] if node_id in holders else []
        params = dict(urllib.parse.parse_qsl(request.url.query.decode()))
        scoped = scope(params.pop("method"), "/files", params)
        try:
            found = signed_files_sandbox(scoped, lambda: tokens)
        except FilesNotRouted as exc:
            return httpx.Response(exc.status, json={"code": exc.status, "message": str(exc)})
        return httpx.Response(200, json={"sandboxID": found})

    nodes = [node(f"node-{i}") for i in range(3)]
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:

        async def ask(params: dict[str, str], method: str = "GET") -> NodeInfo | Refusal:
            query = urllib.parse.urlencode(params).encode()
            return await signer_node(http, nodes, query, method)

        found = await ask(signed("/a", "write", "token-b"), "POST")
        assert isinstance(found, NodeInfo) and found.node_id == "node-1"
        assert sorted(asked) == ["node-0", "node-1", "node-2"]
        refused = await ask(signed("/a", "read", "token-z"))
        assert isinstance(refused, Refusal) and refused.status == 401
        unsigned = await ask({"path": "/a"})
        assert isinstance(unsigned, Refusal) and unsigned.status == 400
        # The holder does not answer: not "invalid", but unavailable.
        silent.add("node-1")
        down = await ask(signed("/a", "read", "token-b"))
        assert isinstance(down, Refusal) and down.status == 503 and "node-1" in down.message
        assert json.loads(bytes(down.response().body))["code"] == 503
