"""Sandbox lifecycle through the official SDK: create, info, timeout, list, connect,
``get_host`` and kill, sync and async."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import (
    E2B,
    AsyncSandbox,
    Sandbox,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
)

from tests.e2b.support import sdk_opts
from tests.helpers import ServerProcess

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def sbx(e2b: E2B) -> Iterator[Sandbox]:
    sandbox = e2b.Sandbox.create(
        timeout=300, metadata={"suite": "e2b-lifecycle", "role": "shared"}, envs={"K": "v"}
    )
    yield sandbox
    sandbox.kill()


def test_create_applies_metadata_envs_and_timeout(sbx: Sandbox) -> None:
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.template_id == "base"
    assert info.state == SandboxState.RUNNING
    assert info.metadata == {"suite": "e2b-lifecycle", "role": "shared"}
    assert dt.timedelta(seconds=290) <= info.end_at - info.started_at <= dt.timedelta(seconds=310)
    assert info.cpu_count >= 1 and info.memory_mb > 0
    assert sbx.commands.run("echo $K").stdout == "v\n"
    assert sbx.is_running()


def test_set_timeout_moves_end_at(sbx: Sandbox) -> None:
    sbx.set_timeout(900)
    longer = sbx.get_info().end_at
    assert longer - dt.datetime.now(dt.UTC) > dt.timedelta(seconds=800)
    # E2B semantics: expiry is now + timeout, so a smaller value shortens it.
    sbx.set_timeout(300)
    shorter = sbx.get_info().end_at
    assert shorter < longer
    assert shorter - dt.datetime.now(dt.UTC) > dt.timedelta(seconds=200)


def test_connect_by_id(e2b: E2B, sbx: Sandbox) -> None:
    same = e2b.Sandbox.connect(sbx.sandbox_id)
    assert same.sandbox_id == sbx.sandbox_id
    assert same.commands.run("echo via-connect").stdout == "via-connect\n"
    with pytest.raises(SandboxNotFoundException):
        e2b.Sandbox.connect("inosuchsandbox")


def test_environment_variables_configure_the_sdk(
    e2b_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a user does: only E2B_* variables, the top-level ``Sandbox`` class."""
    monkeypatch.setenv("E2B_API_URL", e2b_server.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", e2b_server.url)
    monkeypatch.setenv("E2B_API_KEY", e2b_server.api_key)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    with Sandbox.create(timeout=60, metadata={"suite": "e2b-env"}) as sandbox:
        assert sandbox.commands.run("echo env-config").stdout == "env-config\n"
        sandbox_id = sandbox.sandbox_id
    # Leaving the context manager kills the sandbox.
    assert Sandbox.kill(sandbox_id) is False


def test_get_host_reaches_a_server_in_the_sandbox(sbx: Sandbox, e2b_server: ServerProcess) -> None:
    sbx.files.write("/tmp/site/index.html", "served from the sandbox\n")
    web = sbx.commands.run("cd /tmp/site && exec python3 -m http.server 8080", background=True)
    try:
        host = sbx.get_host(8080)
        assert host == f"8080-{sbx.sandbox_id}.localhost:{e2b_server.port}"
        deadline = time.monotonic() + 30
        response = None
        while time.monotonic() < deadline:
            response = httpx.get(
                f"{e2b_server.url}/index.html", headers={"Host": host}, trust_env=False
            )
            if response.status_code == 200:
                break
            time.sleep(0.3)
        assert response is not None and response.status_code == 200, response
        assert response.text == "served from the sandbox\n"
        # A port nothing listens on: the proxy says so (the SDK's "port is not open").
        closed = httpx.get(
            f"{e2b_server.url}/", headers={"Host": sbx.get_host(8081)}, trust_env=False
        )
        assert closed.status_code == 502
        assert "not open" in closed.json()["message"]
    finally:
        web.kill()


def test_list_filters_and_paging(e2b: E2B) -> None:
    made = [e2b.Sandbox.create(timeout=120, metadata={"batch": "sdk paging/ü"}) for _ in range(3)]
    try:
        query = SandboxQuery(metadata={"batch": "sdk paging/ü"}, state=[SandboxState.RUNNING])
        paginator = e2b.Sandbox.list(query=query, limit=2)
        pages: list[list[str]] = []
        while paginator.has_next:
            pages.append([s.sandbox_id for s in paginator.next_items()])
        assert [len(p) for p in pages] == [2, 1]
        assert sorted(i for page in pages for i in page) == sorted(s.sandbox_id for s in made)
        listed = e2b.Sandbox.list(query=query).next_items()
        assert {s.metadata["batch"] for s in listed} == {"sdk paging/ü"}
        assert all(s.state == SandboxState.RUNNING for s in listed)

        # Resuming from a token handed out by an earlier paginator.
        first = e2b.Sandbox.list(query=query, limit=1)
        first.next_items()
        assert first.next_token
        rest = e2b.Sandbox.list(query=query, limit=5, next_token=first.next_token).next_items()
        assert len(rest) == 2

        paused = SandboxQuery(metadata={"batch": "sdk paging/ü"}, state=[SandboxState.PAUSED])
        assert e2b.Sandbox.list(query=paused).next_items() == []
        absent = SandboxQuery(metadata={"batch": "nothing"})
        assert e2b.Sandbox.list(query=absent).next_items() == []
    finally:
        for sandbox in made:
            sandbox.kill()


def test_kill_then_not_found(e2b: E2B, e2b_server: ServerProcess) -> None:
    doomed = e2b.Sandbox.create(timeout=60)
    sandbox_id = doomed.sandbox_id
    assert doomed.kill() is True
    with pytest.raises(SandboxNotFoundException):
        doomed.get_info()
    with pytest.raises(SandboxNotFoundException):
        e2b.Sandbox.get_info(sandbox_id)
    assert e2b.Sandbox.kill(sandbox_id) is False
    assert Sandbox.kill(sandbox_id, **sdk_opts(e2b_server)) is False
    assert doomed.is_running() is False
    with pytest.raises(SandboxNotFoundException):
        e2b.Sandbox.connect(sandbox_id)


# -- async API ----------------------------------------------------------------------------
async def test_async_lifecycle(e2b: E2B) -> None:
    asbx: AsyncSandbox = await e2b.AsyncSandbox.create(
        timeout=120, metadata={"suite": "e2b-async"}, envs={"ASYNC_ENV": "1"}
    )
    try:
        assert (await asbx.commands.run("echo $ASYNC_ENV")).stdout == "1\n"
        info = await asbx.get_info()
        assert info.metadata == {"suite": "e2b-async"}
        assert info.state == SandboxState.RUNNING
        await asbx.set_timeout(200)
        assert (await asbx.get_info()).end_at > info.end_at
        assert await asbx.is_running()

        paginator = e2b.AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "e2b-async"}))
        listed = await paginator.next_items()
        assert [s.sandbox_id for s in listed] == [asbx.sandbox_id]
        assert not paginator.has_next

        again = await e2b.AsyncSandbox.connect(asbx.sandbox_id)
        assert (await again.commands.run("echo ok")).stdout == "ok\n"
    finally:
        assert await asbx.kill() is True
    with pytest.raises(SandboxNotFoundException):
        await asbx.get_info()
    assert await e2b.AsyncSandbox.kill(asbx.sandbox_id) is False
    assert await asbx.is_running() is False
    with pytest.raises(SandboxNotFoundException):
        await e2b.AsyncSandbox.connect(asbx.sandbox_id)
