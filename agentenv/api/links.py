"""OpenAPI links: which answer's id feeds which operation's path.

A create answers ``sandboxID``; every route under ``/sandboxes/{sandbox_id}`` takes it.
Written into the document so clients and tools that follow links (Schemathesis's
stateful phase, which chains a create into pause, connect, fork and kill of the sandbox
it made) need no knowledge of this API beyond it.
"""

from __future__ import annotations

from typing import Any

# (the producing operation's method and path, the answer's id field, the path parameter)
_PRODUCERS = (
    ("post", "/sandboxes", "sandboxID", "sandbox_id"),
    ("post", "/v2/sandboxes", "sandboxID", "sandbox_id"),
)


def add_links(schema: dict[str, Any]) -> None:
    """Link each producer's success answer to every operation whose only path parameter
    is the one its id fills (in place)."""
    paths: dict[str, dict[str, Any]] = schema.get("paths", {})
    for method, path, field, parameter in _PRODUCERS:
        producer = paths.get(path, {}).get(method)
        if producer is None:
            continue
        links: dict[str, Any] = {}
        for consumer_path, item in sorted(paths.items()):
            if consumer_path.count("{") != 1 or f"{{{parameter}}}" not in consumer_path:
                continue
            for operation in item.values():
                operation_id = operation.get("operationId") if isinstance(operation, dict) else None
                if operation_id is None:
                    continue
                links[operation_id] = {
                    "operationId": operation_id,
                    "parameters": {parameter: f"$response.body#/{field}"},
                }
        for status, response in producer.get("responses", {}).items():
            if str(status).startswith("2") and links:
                response["links"] = links
