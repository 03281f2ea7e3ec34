"""Modes (VMM/accelerator) are explicit: what was saved under one mode is refused by a
node of another with a 409 naming both, before anything is fetched, claimed or changed;
``/health`` says which mode the node runs and why. On the fakes of :mod:`tests.fakes`:
their driver is ``fake``, so nodes differ by accelerator (``fake/kvm`` and
``fake/tcg``)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from e2b.api import handle_api_exception
from e2b.exceptions import SandboxException

from agentenv.api.app import create_app
from agentenv.config import Config
from agentenv.orchestrator.errors import ModeMismatch
from agentenv.orchestrator.layout import SandboxDir
from agentenv.orchestrator.modes import Mode
from agentenv.server import choose_runtime, vmm_choice_reason
from tests.fakes import FAKE_TEMPLATE, Node, in_process_client, start_node

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="disk overlays need qemu-img (qemu-utils)"
)

API_KEY = "modes-test-key"


def _key(config: Config) -> Config:
    return config.with_overrides(envd_token_key="5e" * 32)


async def _kvm_and_tcg_nodes(tmp_path: Path) -> tuple[Node, Node]:
    """Node A runs fake/kvm, node B fake/tcg; they share a repository and token key.
    Handoff checks run only when a test calls them."""
    repository = tmp_path / "repository"
    a = await start_node(
        tmp_path / "a",
        repository,
        node_id="node-a",
        accel="kvm",
        watch_handoffs=False,
        configure=_key,
    )
    b = await start_node(
        tmp_path / "b",
        repository,
        node_id="node-b",
        accel="tcg",
        watch_handoffs=False,
        configure=_key,
    )
    return a, b


def _restores(node: Node) -> int:
    return sum(1 for call, _ in node.driver.calls if call == "restore")


async def test_a_snapshot_of_another_mode_is_refused_before_it_is_fetched(tmp_path: Path) -> None:
    a, b = await _kvm_and_tcg_nodes(tmp_path)
    try:
        source = await a.orchestrator.create(FAKE_TEMPLATE)
        snap = await a.orchestrator.snapshot(source.sandbox_id, "kvm-snap", wait_commit=True)
        before = _restores(b)
        with pytest.raises(ModeMismatch) as refused:
            await b.orchestrator.create("kvm-snap")
        message = str(refused.value)
        assert f"snapshot {snap.snapshot_id} was saved under fake/kvm" in message
        assert "this node runs fake/tcg" in message
        # Nothing fetched, restored or recorded on B.
        assert _restores(b) == before
        assert b.orchestrator.catalog.cache.keys() == []
        assert b.orchestrator.store.list_sandboxes() == []
        # The snapshot stays, for every node, and a node of its mode starts from it.
        assert (await b.orchestrator.get_snapshot("kvm-snap")).snapshot_id == snap.snapshot_id
        child = await a.orchestrator.create("kvm-snap")
        assert child.state == "running"
    finally:
        await a.stop()
        await b.stop()


async def test_a_paused_sandbox_of_another_mode_is_not_claimed(tmp_path: Path) -> None:
    """B refuses to adopt what A paused under another mode before claiming it: A's copy
    survives A's handoff check and resumes on A."""
    a, b = await _kvm_and_tcg_nodes(tmp_path)
    try:
        view = await a.orchestrator.create(FAKE_TEMPLATE, metadata={"k": "v"})
        sandbox_id = view.sandbox_id
        await a.orchestrator.pause(sandbox_id)
        upload = a.orchestrator.pending_upload(sandbox_id)
        if upload is not None:
            await asyncio.wait_for(upload, 30)
        generation = SandboxDir(view.record.workdir).generation()
        assert generation > 0

        with pytest.raises(ModeMismatch, match=r"fake/kvm.*fake/tcg") as refused:
            await b.orchestrator.adopt(sandbox_id)
        assert f"sandbox {sandbox_id} (paused on node node-a)" in str(refused.value)
        assert b.orchestrator.store.get_sandbox(sandbox_id) is None
        assert not (b.config.sandboxes_dir / sandbox_id).exists()
        assert await a.orchestrator.catalog.holder(sandbox_id, generation) is None

        await a.orchestrator.check_handoffs()
        assert a.orchestrator.get(sandbox_id).state == "paused"
        resumed = await a.orchestrator.resume(sandbox_id)
        assert resumed.state == "running" and resumed.record.metadata == {"k": "v"}
    finally:
        await a.stop()
        await b.stop()


async def test_a_node_restarted_in_another_mode_keeps_what_it_cannot_restore(
    tmp_path: Path,
) -> None:
    """A paused sandbox stays paused (its saved state kept) and its template stays; the
    node back in their mode resumes and creates from them."""
    home, repository = tmp_path / "a", tmp_path / "repository"
    node = await start_node(home, repository, accel="tcg")
    view = await node.orchestrator.create(FAKE_TEMPLATE)
    sandbox_id = view.sandbox_id
    await node.orchestrator.pause(sandbox_id)
    network = node.network
    await node.stop()

    other = await start_node(home, repository, network=network, accel="kvm")
    try:
        paused = SandboxDir(view.record.workdir).paused_manifest
        saved = paused.read_text()
        with pytest.raises(ModeMismatch) as refused:
            await other.orchestrator.resume(sandbox_id)
        assert f"paused sandbox {sandbox_id} was saved under fake/tcg" in str(refused.value)
        assert "this node runs fake/kvm" in str(refused.value)
        assert other.orchestrator.get(sandbox_id).state == "paused"
        assert paused.read_text() == saved
        with pytest.raises(ModeMismatch, match=f"template {FAKE_TEMPLATE} was saved under"):
            await other.orchestrator.create(FAKE_TEMPLATE)
        assert all(call != "restore" for call, _ in other.driver.calls)
    finally:
        await other.stop()

    back = await start_node(home, repository, network=network, accel="tcg")
    try:
        assert (await back.orchestrator.resume(sandbox_id)).state == "running"
        assert (await back.orchestrator.create(FAKE_TEMPLATE)).state == "running"
    finally:
        await back.stop()


async def test_a_vm_still_running_from_another_mode_forks_no_children(tmp_path: Path) -> None:
    """After a restart in another mode the fake driver re-attaches a VM still running
    under the old accelerator (as QEMU does across a KVM/TCG change): its fork image is
    saved under that one, so each child is refused and the parent runs on."""
    home, repository = tmp_path / "a", tmp_path / "repository"
    node = await start_node(home, repository, accel="tcg")
    parent = await node.orchestrator.create(FAKE_TEMPLATE)
    network = node.network
    await node.stop()
    other = await start_node(home, repository, network=network, accel="kvm")
    try:
        results = await other.orchestrator.fork(parent.sandbox_id, 2)
        assert len(results) == 2
        for result in results:
            assert isinstance(result, ModeMismatch), result
            assert "was saved under fake/tcg; this node runs fake/kvm" in str(result)
        assert other.orchestrator.get(parent.sandbox_id).state == "running"
        assert [v.sandbox_id for v in other.orchestrator.list_sandboxes()] == [parent.sandbox_id]
    finally:
        await other.stop()


async def test_the_api_answers_409_naming_both_modes_and_health_says_why(
    tmp_path: Path,
) -> None:
    a, b = await _kvm_and_tcg_nodes(tmp_path)
    try:
        view = await a.orchestrator.create(FAKE_TEMPLATE)
        await a.orchestrator.snapshot(view.sandbox_id, "kvm-snap", wait_commit=True)
        app = create_app(b.orchestrator, API_KEY, manage_lifecycle=False)
        async with in_process_client(app, API_KEY) as client:
            created = await client.post("/sandboxes", json={"templateID": "kvm-snap"})
            assert created.status_code == 409, created.text
            body = created.json()
            assert (body["code"], body["error_code"]) == (409, "mode_mismatch")
            assert "fake/kvm" in body["message"] and "fake/tcg" in body["message"]
            # What the e2b SDK raises for it (its create and connect hand any status
            # >= 300 to handle_api_exception): a SandboxException carrying the message.
            raised = handle_api_exception(created)
            assert type(raised) is SandboxException and raised.status_code == 409
            assert body["message"] in str(raised)

            await a.orchestrator.pause(view.sandbox_id)
            upload = a.orchestrator.pending_upload(view.sandbox_id)
            if upload is not None:
                await asyncio.wait_for(upload, 30)
            connected = await client.post(f"/sandboxes/{view.sandbox_id}/connect", json={})
            assert connected.status_code == 409, connected.text
            assert "fake/kvm" in connected.json()["message"]

            # /health says the mode and why.
            health = await client.get("/health")
        assert health.status_code == 200
        data = health.json()
        assert (data["vmm"], data["accel"], data["mode"]) == ("fake", "tcg", "fake/tcg")
        assert data["modeReason"] == "accel=tcg: set explicitly"
    finally:
        await a.stop()
        await b.stop()


def test_a_mode_is_read_from_saved_files_and_repository_manifests() -> None:
    node = Mode("qemu", "tcg")
    manifest = {"version": 1, "files": {"driver": "firecracker", "accel": "kvm", "shape": {}}}
    saved = Mode.of_manifest(manifest)
    assert saved == Mode("firecracker", "kvm") and str(saved) == "firecracker/kvm"
    with pytest.raises(ModeMismatch) as refused:
        node.require("snapshot s1", saved)
    assert str(refused.value).startswith(
        "snapshot s1 was saved under firecracker/kvm; this node runs qemu/tcg"
    )
    assert (refused.value.saved, refused.value.node) == ("firecracker/kvm", "qemu/tcg")
    node.require("snapshot s2", Mode("qemu", "tcg"))
    # A manifest naming no mode is left to fail where its files are read.
    assert Mode.of_manifest({"files": {"driver": "qemu"}}) is None
    assert Mode.of_manifest({}) is None
    node.require("snapshot s3", None)


def test_the_mode_reason_says_why_auto_chose() -> None:
    assert vmm_choice_reason("auto", "firecracker", "kvm") == (
        "vmm=auto: hardware KVM and a Firecracker binary, so firecracker"
    )
    assert "Firecracker needs hardware KVM" in vmm_choice_reason("auto", "qemu", "tcg")
    assert "no Firecracker binary" in vmm_choice_reason("auto", "qemu", "kvm")
    assert vmm_choice_reason("qemu", "qemu", "kvm") == "vmm=qemu: set explicitly"
    runtime = choose_runtime(
        Config(home=Path("/nonexistent"), vmm="auto", accel="tcg", confine_vmm=False)
    )
    assert (runtime.driver.name, runtime.accel) == ("qemu", "tcg")
    assert runtime.reason == (
        "vmm=auto: Firecracker needs hardware KVM, so qemu; accel=tcg: set explicitly"
    )
