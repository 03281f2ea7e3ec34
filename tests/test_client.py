"""``agentenv.client`` against a live server: fork (sync and async) into SDK objects,
snapshots, lineage, node health, error mapping, rollouts, and the runnable example and
README snippet that show them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator

import e2b
import pytest

from agentenv.client import (
    AgentEnv,
    AgentEnvError,
    AsyncAgentEnv,
    AuthError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    UnreachableError,
    rollout,
    rollout_async,
)
from tests.helpers import ROOT, ServerProcess, free_port

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[AgentEnv]:
    with AgentEnv(server.url, server.api_key) as env:
        yield env


@pytest.fixture
def parent(client: AgentEnv) -> Iterator[e2b.Sandbox]:
    """A running sandbox with a file the tests expect its forks to see."""
    sandbox = client.create(timeout=180)
    sandbox.files.write("/home/user/state", "prepared")
    yield sandbox
    client.kill(sandbox)


def live_ids(client: AgentEnv) -> set[str]:
    return {s.sandbox_id for s in client.list_sandboxes()}


def test_health_needs_the_key(server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AENV_API_KEY", raising=False)
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with AgentEnv(server.url) as anonymous, pytest.raises(AuthError, match="API key"):
        assert anonymous.connection.api_key is None
        anonymous.health()  # refused before anything is sent
    with AgentEnv(server.url, "wrong-key") as intruder, pytest.raises(AuthError) as auth:
        intruder.health()
    assert auth.value.status == 401
    with AgentEnv(server.url, server.api_key) as env:
        health = env.health()
    assert health.status == "ok"
    assert health.templates["base"] == "ready"
    assert health.vmm in ("qemu", "firecracker")


def test_fork_gives_sdk_sandboxes_with_the_parents_files_and_lineage(
    client: AgentEnv, parent: e2b.Sandbox
) -> None:
    children = client.fork(parent, 2, timeout=120)
    try:
        assert all(isinstance(child, e2b.Sandbox) for child in children), children
        sandboxes = [c for c in children if isinstance(c, e2b.Sandbox)]
        for i, sandbox in enumerate(sandboxes):
            assert sandbox.commands.run("cat /home/user/state").stdout == "prepared"
            sandbox.files.write("/home/user/state", f"child {i}")
        # Each child's disk is its own from the fork on.
        assert parent.files.read("/home/user/state") == "prepared"
        assert sandboxes[1].files.read("/home/user/state") == "child 1"

        lineage = client.lineage(sandboxes[0])
        assert lineage.parent_id == parent.sandbox_id
        assert lineage.snapshot_id is not None
        assert set(client.lineage(parent).children) == {c.sandbox_id for c in sandboxes}
    finally:
        for child in children:
            if isinstance(child, e2b.Sandbox):
                client.kill(child)
    assert client.lineage(parent.sandbox_id).children == []


async def test_async_fork_gives_async_sdk_sandboxes(server: ServerProcess) -> None:
    async with AsyncAgentEnv(server.url, server.api_key) as client:
        parent = await client.create(timeout=120)
        try:
            await parent.files.write("/home/user/state", "prepared")
            children = await client.fork(parent, 2, timeout=120)
            assert all(isinstance(c, e2b.AsyncSandbox) for c in children), children
            for child in children:
                assert isinstance(child, e2b.AsyncSandbox)
                run = await child.commands.run("cat /home/user/state")
                assert run.stdout == "prepared"
                assert (await client.lineage(child)).parent_id == parent.sandbox_id
                assert await client.kill(child)
        finally:
            await client.kill(parent)
        assert not await client.kill(parent), "a second kill finds nothing"


def test_snapshots_create_list_get_delete(client: AgentEnv, parent: e2b.Sandbox) -> None:
    name = f"client-test-{uuid.uuid4().hex[:8]}"
    named = client.snapshot(parent, name=name)
    unnamed = client.snapshot(parent.sandbox_id)
    try:
        assert named.names == [name]
        assert named.sandbox_id == parent.sandbox_id
        assert client.get_snapshot(named.snapshot_id).names == [name]
        assert client.get_snapshot(unnamed) == unnamed

        page = client.list_snapshots(sandbox=parent, limit=1)
        assert len(page.items) == 1 and page.next_token is not None
        every = [s.snapshot_id for s in client.iter_snapshots(sandbox=parent, page_size=1)]
        # Newest first, as E2B lists snapshots.
        assert every == [unnamed.snapshot_id, named.snapshot_id]
        assert [s.snapshot_id for s in client.list_snapshots(name=name).items] == [
            named.snapshot_id
        ]

        # A snapshot's name starts a sandbox in place of a template.
        restored = client.create(template=name, timeout=60)
        try:
            assert restored.files.read("/home/user/state") == "prepared"
            assert client.lineage(restored).source_id in (name, named.snapshot_id)
        finally:
            client.kill(restored)
    finally:
        assert client.delete_snapshot(named)
        assert client.delete_snapshot(unnamed.snapshot_id)
    with pytest.raises(NotFoundError):
        client.get_snapshot(named.snapshot_id)
    assert not client.delete_snapshot(named.snapshot_id)


def test_errors_are_mapped(client: AgentEnv, server: ServerProcess) -> None:
    with pytest.raises(NotFoundError) as not_found:
        client.get("no-such-sandbox")
    assert not_found.value.status == 404 and "no-such-sandbox" in not_found.value.message
    with pytest.raises(NotFoundError):
        client.fork("no-such-sandbox", 2)
    assert client.kill("no-such-sandbox") is False
    # The calls made through the SDK raise the same exceptions.
    with pytest.raises(NotFoundError):
        client.connect("no-such-sandbox")
    with pytest.raises(InvalidRequestError):
        client.create(template="no-such-template")

    with AgentEnv(server.url, "wrong-key") as intruder, pytest.raises(AuthError) as auth:
        intruder.list_sandboxes()
    assert auth.value.status == 401

    with (
        AgentEnv(f"http://127.0.0.1:{free_port()}", "key") as nowhere,
        pytest.raises(UnreachableError) as unreachable,
    ):
        nowhere.health()
    assert unreachable.value.status is None
    assert isinstance(unreachable.value, AgentEnvError)


def test_fork_of_a_paused_sandbox_is_a_conflict(client: AgentEnv, parent: e2b.Sandbox) -> None:
    parent.pause()
    with pytest.raises(ConflictError) as conflict:
        client.fork(parent, 2)
    assert conflict.value.status == 409
    assert client.get(parent).state == "paused"


def test_rollout_kills_children_even_when_the_policy_raises(
    client: AgentEnv, parent: e2b.Sandbox
) -> None:
    def policy(child: e2b.Sandbox, index: int) -> str:
        if index == 1:
            raise RuntimeError("policy 1 gave up")
        return child.commands.run(f"echo {index} $(cat /home/user/state)").stdout.strip()

    results = rollout(client, parent, 3, policy, timeout=120)

    assert [r.index for r in results] == [0, 1, 2]
    assert results[0].value == "0 prepared" and results[2].value == "2 prepared"
    assert isinstance(results[1].error, RuntimeError) and not results[1].ok
    assert all(r.sandbox_id and r.seconds > 0 for r in results)
    assert not {r.sandbox_id for r in results} & live_ids(client)
    assert client.lineage(parent).children == []


async def test_async_rollout_snapshots_each_child(
    server: ServerProcess, client: AgentEnv, parent: e2b.Sandbox
) -> None:
    async def policy(child: e2b.AsyncSandbox, index: int) -> int:
        await child.files.write("/home/user/state", f"after {index}")
        return index * index

    async with AsyncAgentEnv(server.url, server.api_key) as aclient:
        results = await rollout_async(aclient, parent, 2, policy, after="snapshot", timeout=120)
    try:
        assert [r.value for r in results] == [0, 1]
        assert all(r.ok and r.snapshot is not None for r in results), results
        for r in results:
            assert r.snapshot is not None and r.snapshot.sandbox_id == r.sandbox_id
        assert not {r.sandbox_id for r in results} & live_ids(client)
        # The snapshot keeps what the policy left behind.
        assert results[1].snapshot is not None
        replay = client.create(template=results[1].snapshot.snapshot_id, timeout=60)
        try:
            assert replay.files.read("/home/user/state") == "after 1"
        finally:
            client.kill(replay)
    finally:
        for r in results:
            if r.snapshot is not None:
                client.delete_snapshot(r.snapshot)


def connection_env(server: ServerProcess) -> dict[str, str]:
    return {
        "AENV_SERVER": server.url,
        "AENV_API_KEY": server.api_key,
        "E2B_SANDBOX_URL": server.url,
    }


def test_example_script_runs_and_cleans_up(client: AgentEnv, server: ServerProcess) -> None:
    before = live_ids(client)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "AENV_"))}
    env.update(connection_env(server))
    done = subprocess.run(
        [sys.executable, "examples/rollout.py", "--n", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [row[0] for row in rows] == ["0", "1"], done.stdout
    assert all(re.fullmatch(r"-?\d+", row[2]) for row in rows), done.stdout
    assert "best: child" in done.stdout
    parent_id = re.search(r"^parent (\S+):", done.stdout, re.M)
    assert parent_id, done.stdout
    printed = {parent_id.group(1)} | {row[1] for row in rows}
    assert len(printed) == 3, done.stdout
    assert not printed & live_ids(client)
    assert live_ids(client) <= before


def readme_python_client_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Python client\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the Python client section has no python block"
    return match.group(1)


def test_readme_example_runs(
    client: AgentEnv,
    server: ServerProcess,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in list(os.environ):
        if name.startswith(("E2B_", "AENV_")):
            monkeypatch.delenv(name)
    for name, value in connection_env(server).items():
        monkeypatch.setenv(name, value)
    before = live_ids(client)

    exec(compile(readme_python_client_block(), "README.md", "exec"), {})

    out = capsys.readouterr().out
    assert "42" in out, out
    assert live_ids(client) <= before
