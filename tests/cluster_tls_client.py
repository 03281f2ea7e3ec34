"""Run by ``test_cluster_tls`` in a process of its own, configured as a user of E2B's cloud
would be: ``E2B_DOMAIN`` (the TLS gateway's) and ``E2B_API_KEY`` only, plus
``SSL_CERT_FILE`` trusting the cluster's CA (a process of its own because the SDK reads
the trusted certificates once per process). Creates one sandbox per node through the
gateway and drives each (commands, files, a PTY, signed URLs, a port), then prints one JSON
object describing what it saw. Killing the sandboxes is left to the test."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import pyqwest
from e2b import PtySize, Sandbox

_client = pyqwest.SyncClient(pyqwest.SyncHTTPTransport(tls_include_system_certs=True))


def fetch(url: str) -> tuple[int, str]:
    """A client with no sandbox headers (a browser, curl)."""
    response = _client.get(url)
    return response.status, bytes(response.content).decode(errors="replace")


def drive(sbx: Sandbox, index: int) -> dict[str, Any]:
    seen: dict[str, Any] = {"sandbox_id": sbx.sandbox_id, "envd_url": sbx.envd_api_url}
    seen["echo"] = sbx.commands.run(f"echo node says {index}").stdout
    payload = bytes(range(256)) * 4096  # 1 MiB, streamed both ways
    sbx.files.write(f"/tmp/blob-{index}", payload)
    seen["blob"] = sbx.files.read(f"/tmp/blob-{index}", format="bytes") == payload
    sbx.files.write("/home/user/signed.txt", f"signed {index}")
    url = sbx.download_url("/home/user/signed.txt", use_signature_expiration=120)
    seen["download_url"] = url
    seen["download"] = fetch(url)
    pty = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
    sbx.pty.send_stdin(pty.pid, b"stty size; echo pty-$((6*7)); exit 0\n")
    output = bytearray()
    seen["pty_exit"] = pty.wait(on_pty=output.extend).exit_code
    seen["pty"] = output.decode(errors="replace")
    # A port of the sandbox at https://{port}-{id}.{domain}, through the gateway.
    sbx.files.write("/tmp/site/index.html", f"port {index}")
    sbx.commands.run("cd /tmp/site && exec python3 -m http.server 8080", background=True)
    seen["host"] = sbx.get_host(8080)
    seen["port"] = (0, "")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        seen["port"] = fetch(f"https://{seen['host']}/index.html")
        if seen["port"][0] == 200:
            break
        time.sleep(0.5)
    return seen


def main(count: int) -> dict[str, Any]:
    created = [Sandbox.create(timeout=600) for _ in range(count)]
    flows = [drive(sbx, index) for index, sbx in enumerate(created)]
    listed = {info.sandbox_id for info in Sandbox.list().next_items()}
    again = Sandbox.connect(created[0].sandbox_id)
    reconnected = again.commands.run("echo again").stdout
    return {"flows": flows, "listed": sorted(listed), "reconnected": reconnected}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
