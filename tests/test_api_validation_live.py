"""Issue #12's bad inputs against a live server over real HTTP (uvicorn): what the
in-process tests (tests/test_api_validation.py) cannot see, a body refused by its
length before it is sent, and that a refused create starts no VMM process."""

from __future__ import annotations

import json
import socket

import pytest

from tests.helpers import ServerProcess, vmm_pids

pytestmark = pytest.mark.vm


def _raw(server: ServerProcess, request: bytes) -> tuple[int, dict[str, object]]:
    """Send ``request`` as it is and read the answer: its status and JSON body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    status = int(head.split(b" ", 2)[1])
    parsed = json.loads(body)
    assert isinstance(parsed, dict)
    return status, parsed


def test_bad_inputs_are_refused_over_http_before_any_vm(server: ServerProcess) -> None:
    marker = str(server.home)
    vmms = sorted(vmm_pids(marker))
    with server.client() as c:
        sandboxes = c.get("/sandboxes").json()
        for body in (
            {"templateID": "base", "envVars": {"A=B": "x"}},
            {"templateID": "base", "envVars": {"": "x"}},
            {"templateID": "base", "timeout": 0},
            {"templateID": "t" * 201},
            {"templateID": "/base"},
        ):
            refused = c.post("/v2/sandboxes", json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["code"] == 400
        huge = c.post(
            "/v2/sandboxes", json={"templateID": "base", "metadata": {"k": "v" * (10 << 20)}}
        )
        assert huge.status_code == 413 and huge.json()["code"] == 413
        for path in ("/snapshots/%C3%A9", "/templates/aliases/%C3%A9"):
            missing = c.get(path)
            assert missing.status_code == 404 and missing.json()["code"] == 404, path
        assert c.get("/v2/sandboxes", params={"nextToken": "garbage"}).status_code == 400
        registered = c.post("/v3/templates", json={"name": "live-validation"})
        assert registered.status_code == 202, registered.text
        template_id = registered.json()["templateID"]
        upload = c.put(
            f"/templates/{template_id}/files/{'ab' * 32}/upload?token=%C3%A9", content=b"x"
        )
        assert upload.status_code == 403 and upload.json()["code"] == 403
        assert c.post("/v3/templates", json={"name": "live-validation"}).status_code == 409
        assert c.get("/sandboxes").json() == sandboxes
    # A body announced too large is refused before it is sent.
    status, answer = _raw(
        server,
        b"POST /v2/sandboxes HTTP/1.1\r\nHost: x\r\n"
        + f"X-API-Key: {server.api_key}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: 104857600\r\n\r\n{",
    )
    assert status == 413 and answer["code"] == 413
    assert sorted(vmm_pids(marker)) == vmms, "a refused request started a VMM"
    # A request uvicorn cannot parse (a control character in its target) is refused
    # before the app, with the same JSON error.
    status, answer = _raw(server, b"GET /v2/sandboxes?x=\x01y HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 400 and answer["code"] == 400, answer
