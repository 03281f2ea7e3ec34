"""The in-guest code-interpreter server (agentenv/interpreter) run on the host, with a
real ipykernel: the NDJSON lines it streams, contexts, per-call environment, interrupt on
disconnect, a dying kernel, and the size limit of one line's fields. (The VM tests in
tests/e2b/test_sdk_code_interpreter.py drive it through the SDK in a sandbox.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.interpreter import wire
from tests.helpers import ROOT, free_port


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("interp-home")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            sys.executable,
            *("-m", "agentenv.interpreter", "--host", "127.0.0.1"),
            *("--port", str(port), "--home", str(home)),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the interpreter server did not become healthy")
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def execute(url: str, *, keepalives: bool = False, **body: Any) -> list[dict[str, Any]]:
    """The lines of one call (without its keepalive lines unless asked)."""
    with httpx.stream("POST", f"{url}/execute", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [json.loads(line) for line in response.iter_lines() if line]
    return [line for line in lines if keepalives or line["type"] != "keepalive"]


def test_lines_for_output_results_and_errors(url: str) -> None:
    lines = execute(url, code="print('a')\nv = 20\nv + 1")
    kinds = [line["type"] for line in lines]
    assert kinds == ["number_of_executions", "stdout", "result", "end_of_execution"]
    assert lines[1]["text"] == "a\n" and lines[1]["timestamp"] > 0
    assert lines[2]["text"] == "21" and lines[2]["is_main_result"] is True
    error = execute(url, code="v / 0")[1]
    assert error["type"] == "error" and error["name"] == "ZeroDivisionError"
    assert "ZeroDivisionError" in error["traceback"]
    html = execute(url, code="from IPython.display import HTML, display\ndisplay(HTML('<i>x</i>'))")
    assert html[1]["html"] == "<i>x</i>" and html[1]["is_main_result"] is False


def test_contexts_and_languages(url: str, tmp_path: Path) -> None:
    created = httpx.post(f"{url}/contexts", json={"cwd": str(tmp_path), "language": "bash"})
    assert created.status_code == 200
    context = created.json()
    assert context["language"] == "bash" and context["cwd"] == str(tmp_path)
    assert (
        execute(url, code="A=1; cd ..", context_id=context["id"])[-1]["type"] == "end_of_execution"
    )
    out = execute(url, code="echo $A; pwd", context_id=context["id"])
    assert [line["text"] for line in out if line["type"] == "stdout"] == [
        "1\n",
        f"{tmp_path.parent}\n",
    ]
    listed = httpx.get(f"{url}/contexts").json()
    assert context in listed and any(c["language"] == "python" for c in listed)
    assert httpx.post(f"{url}/contexts/{context['id']}/restart").status_code == 204
    out = execute(url, code="echo ${A:-gone}", context_id=context["id"])
    assert out[0]["text"] == "gone\n"
    assert httpx.delete(f"{url}/contexts/{context['id']}").status_code == 204
    assert httpx.delete(f"{url}/contexts/{context['id']}").status_code == 404
    missing = httpx.post(f"{url}/execute", json={"code": "1", "context_id": "nope"})
    assert missing.status_code == 404 and "nope" in missing.text
    other = httpx.post(f"{url}/execute", json={"code": "1", "language": "r"})
    assert other.status_code == 400 and "python, bash" in other.text
    bad = httpx.post(f"{url}/contexts", json={"cwd": "/no/such/dir"})
    assert bad.status_code == 400


def test_envs_apply_to_one_call(url: str) -> None:
    code = "import os; str(os.environ.get('UNIT_VAR'))"
    assert execute(url, code=code, env_vars={"UNIT_VAR": "x"})[1]["text"] == "'x'"
    assert execute(url, code=code)[1]["text"] == "'None'"


def test_disconnect_interrupts_only_its_call(url: str) -> None:
    code = "import time\ntime.sleep(30)\nslept = True"
    with httpx.stream("POST", f"{url}/execute", json={"code": code}, timeout=60) as response:
        for _ in response.iter_lines():
            break  # the call has started; leaving unread closes the connection
    lines = execute(url, code="'slept' in dir()")
    assert [line["text"] for line in lines if line["type"] == "result"] == ["False"]
    keepalives = execute(url, code="import time; time.sleep(2.5)", keepalives=True)
    assert [line["type"] for line in keepalives].count("keepalive") >= 1


def test_a_dying_kernel_answers_an_error_then_restarts(url: str) -> None:
    context = httpx.post(f"{url}/contexts", json={}).json()
    died = execute(url, code="import os; os._exit(3)", context_id=context["id"])
    assert [line["name"] for line in died if line["type"] == "error"] == ["KernelDied"]
    again = execute(url, code="6 * 7", context_id=context["id"])
    assert [line.get("text") for line in again if line["type"] == "result"] == ["42"]


def test_fields_over_the_limit_are_cut_or_left_out() -> None:
    text = json.loads(
        wire.result({"text/plain": "x" * 50, "image/png": "p" * 50}, is_main_result=True, limit=10)
    )
    assert text["text"].startswith("x" * 10) and "truncated: 40 characters" in text["text"]
    assert "png" not in text and text["extra"]["agentenv_omitted"] == [
        "image/png: 50 characters, over the 10 limit"
    ]
    assert json.loads(wire.result({"text/plain": "ok"}, is_main_result=False))["text"] == "ok"
