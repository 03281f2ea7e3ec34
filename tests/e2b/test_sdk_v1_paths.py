"""An older SDK release, which creates with ``POST /sandboxes`` (sending ``secure: true``)
and connects with ``POST /sandboxes/{id}/connect``, run in its own virtualenv.

e2b 2.40.0 is the last line before the /v2 paths that also validates the API key's shape
client-side. Its virtualenv is built once (PyPI only) and cached under
``/var/cache/agentenv/test-venvs``; the script runs there as a subprocess and reports what
it saw as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ServerProcess, cached_venv

pytestmark = pytest.mark.vm

OLD_SDK_VERSION = "2.40.0"

SCRIPT = r"""
import json, sys
import httpx
from e2b import Sandbox, CommandExitException, SandboxException

out = {"requests": []}
_send = httpx.Client.send


def recording_send(self, request, *args, **kwargs):
    entry = {"method": request.method, "path": request.url.path}
    if request.url.path == "/sandboxes" and request.method == "POST":
        entry["body"] = json.loads(request.content)
    out["requests"].append(entry)
    return _send(self, request, *args, **kwargs)


httpx.Client.send = recording_send
sbx = Sandbox.create(timeout=120, metadata={"sdk": "old"}, envs={"OLD": "sdk"})
out["id"] = sbx.sandbox_id
out["run"] = sbx.commands.run("echo $OLD; id -un").stdout
try:
    sbx.commands.run("exit 5")
except CommandExitException as e:
    out["exit"] = e.exit_code
sbx.files.write("/home/user/old.txt", "written by " + sys.argv[1])
out["read"] = sbx.files.read("/home/user/old.txt")
out["bytes"] = len(bytes(sbx.files.read("/home/user/old.txt", format="bytes")))
same = Sandbox.connect(sbx.sandbox_id)
out["connect"] = same.commands.run("cat /home/user/old.txt").stdout
out["info_metadata"] = sbx.get_info().metadata
out["kill"] = sbx.kill()
out["kill_again"] = Sandbox.kill(out["id"])
try:
    Sandbox.connect(out["id"])
    out["connect_after_kill"] = "connected"
except SandboxException as e:
    out["connect_after_kill"] = type(e).__name__
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def old_sdk_python() -> Path:
    """The Python of a cached virtualenv with the old SDK."""
    return cached_venv(f"e2b-{OLD_SDK_VERSION}", f"e2b=={OLD_SDK_VERSION}") / "bin" / "python"


def test_old_sdk_uses_v1_paths(old_sdk_python: Path, e2b_server: ServerProcess) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_") and k != "PYTHONPATH"}
    env.update(
        E2B_API_URL=e2b_server.url,
        E2B_SANDBOX_URL=e2b_server.url,
        E2B_API_KEY=e2b_server.api_key,  # e2b_<hex>: passes 2.40's client-side check
        NO_PROXY="127.0.0.1,localhost",
    )
    proc = subprocess.run(
        [str(old_sdk_python), "-c", SCRIPT, "old-sdk"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["run"] == "sdk\nuser\n"
    assert seen["exit"] == 5
    assert seen["read"] == "written by old-sdk"
    assert seen["bytes"] == len("written by old-sdk")
    assert seen["connect"] == "written by old-sdk"
    assert seen["info_metadata"] == {"sdk": "old"}
    assert seen["kill"] is True
    assert seen["kill_again"] is False
    assert seen["connect_after_kill"] == "SandboxNotFoundException"
    with e2b_server.client() as c:
        assert c.get(f"/sandboxes/{seen['id']}").status_code == 404

    control = [(r["method"], r["path"]) for r in seen["requests"]]
    sandbox_id = seen["id"]
    assert control[0] == ("POST", "/sandboxes")
    assert ("POST", f"/sandboxes/{sandbox_id}/connect") in control
    assert not [p for _, p in control if p.startswith("/v2/sandboxes/")]
    create_body = seen["requests"][0]["body"]
    assert create_body["secure"] is True
    assert create_body["templateID"] == "base"
