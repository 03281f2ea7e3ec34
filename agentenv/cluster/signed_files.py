"""Signed ``/files`` URLs that name no sandbox, at the gateway: the URL's signature is the
only thing saying which sandbox it is for, and only the node holding that sandbox can
check it (the gateway holds no tokens). Every up node is asked at once
(``agentenv.proxy.signed.SIGNER_PATH``); the URL is relayed to the one that answers yes.
"""

from __future__ import annotations

import asyncio

import httpx

from agentenv.cluster.models import NodeInfo
from agentenv.proxy.forward import Refusal
from agentenv.proxy.signed import SIGNER_PATH, signer_query

# A node answers from its records alone, without reaching a guest.
PROBE_TIMEOUT_S = 10.0


async def signer_node(
    http: httpx.AsyncClient, nodes: list[NodeInfo], query: bytes, method: str
) -> NodeInfo | Refusal:
    """The node one of whose sandboxes signed the URL with this query (used with
    ``method``), or the answer for the client: the nodes' 400 or 401 when none did, a 503
    when a node that might hold it did not answer."""
    probe_query = signer_query(query, method)

    async def ask(node: NodeInfo) -> httpx.Response | None:
        url = httpx.URL(node.report.url).copy_with(
            raw_path=SIGNER_PATH.encode() + b"?" + probe_query
        )
        try:
            return await http.get(url, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return None

    answers = await asyncio.gather(*(ask(node) for node in nodes))
    refusal = Refusal(401, "invalid signature (made for no sandbox in this cluster)")
    silent: list[str] = []
    for node, answer in zip(nodes, answers, strict=True):
        if answer is None or answer.status_code >= 500:
            silent.append(node.node_id)
        elif answer.status_code == 200:
            return node
        elif answer.status_code == 400:
            try:
                message = str(answer.json()["message"])
            except (ValueError, KeyError, TypeError):
                message = "bad request"
            refusal = Refusal(400, message)
    if silent and refusal.status == 401:
        return Refusal(
            503,
            f"node unavailable: the URL's sandbox may be on {', '.join(silent)}, "
            "which did not answer",
        )
    return refusal
