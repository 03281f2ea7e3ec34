"""Unit tests of issue #11's data hygiene: derived envd tokens and what the store keeps of
them, the start-up permission pass, metadata and env var limits, snapshot names, and the
free-space floor (with fakes; tests/security/test_hygiene.py runs them for real)."""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentenv.api.models import NewSandbox, SnapshotRequest
from agentenv.config import Config, ConfigError
from agentenv.limits import (
    MAX_ENV_VARS,
    MAX_METADATA_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_METADATA_VALUE_LENGTH,
)
from agentenv.orchestrator.errors import BelowFreeSpaceFloor, InvalidRequest
from agentenv.orchestrator.states import SandboxState
from agentenv.orchestrator.store import SandboxRecord, Store, utcnow
from agentenv.orchestrator.tokens import KEY_FILE, EnvdTokens, TokenKeyMismatch, token_digest
from agentenv.server import PRIVATE_UMASK, make_data_private
from agentenv.storage.oci import prepare_rootfs
from tests.fakes import FAKE_TEMPLATE, Node, start_node

# -- envd tokens ---------------------------------------------------------------------------


def test_tokens_are_derived_per_sandbox_and_key() -> None:
    one, other = EnvdTokens(b"k" * 32), EnvdTokens(b"q" * 32)
    assert one.token("ia") == EnvdTokens(b"k" * 32).token("ia")
    assert len({one.token("ia"), one.token("ib"), other.token("ia")}) == 3
    assert len(one.token("ia")) >= 40  # 256 bits, base64url


def test_stored_form_is_a_digest_and_restores_the_token() -> None:
    tokens = EnvdTokens(b"k" * 32)
    token = tokens.token("ia")
    stored = tokens.stored("ia", token)
    assert stored == token_digest(token) and token not in str(stored)
    assert tokens.restored("ia", stored) == token
    with pytest.raises(TokenKeyMismatch):
        EnvdTokens(b"q" * 32).restored("ia", stored)
    # A token from before tokens were derived is kept and given back as it is.
    assert tokens.stored("ia", "legacy-random") == "legacy-random"
    assert tokens.restored("ia", "legacy-random") == "legacy-random"
    assert tokens.stored("ia", None) is None and tokens.restored("ia", None) is None


def test_key_file_is_made_once_and_private(tmp_path: Path) -> None:
    path = tmp_path / "home" / KEY_FILE
    first = EnvdTokens.load(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert EnvdTokens.load(path).token("ia") == first.token("ia")
    configured = EnvdTokens.configured("ab" * 32, tmp_path / "unused")
    assert configured.token("ia") == EnvdTokens(bytes.fromhex("ab" * 32)).token("ia")
    assert not (tmp_path / "unused").exists()


def _record(tmp_path: Path, sandbox_id: str, token: str | None) -> SandboxRecord:
    now = utcnow()
    return SandboxRecord(
        sandbox_id=sandbox_id,
        template_id="base",
        template_build_id="b1",
        state=SandboxState.RUNNING,
        slot=len(sandbox_id),
        workdir=tmp_path / sandbox_id,
        started_at=now,
        end_at=now + timedelta(seconds=60),
        vcpus=1,
        memory_mib=256,
        disk_size_mib=1024,
        envd_version="0.2.0",
        envd_token=token,
    )


def test_state_db_holds_no_token(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = Store(db)
    store.open()
    token = store.tokens.token("isecured")
    traffic = store.tokens.traffic_token("isecured")
    assert traffic != token
    record = _record(tmp_path, "isecured", token)
    record.traffic_token = traffic
    store.insert_sandbox(record)
    store.update_sandbox("isecured", envd_token=token, traffic_token=traffic)
    got = store.get_sandbox("isecured")
    assert got is not None and got.envd_token == token and got.traffic_token == traffic
    store.close()
    raw = sqlite3.connect(db).execute("SELECT envd_token, traffic_token FROM sandboxes")
    assert tuple(raw.fetchone()) == (token_digest(token), token_digest(traffic))
    for path in tmp_path.glob("state.db*"):
        assert token.encode() not in path.read_bytes()
        assert traffic.encode() not in path.read_bytes()
    # Reopened with the same key file: the tokens come back.
    again = Store(db)
    again.open()
    assert [(r.envd_token, r.traffic_token) for r in again.list_sandboxes()] == [(token, traffic)]
    again.close()


def test_rows_with_raw_tokens_from_older_servers_keep_working(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = Store(db)
    store.open()
    store.insert_sandbox(_record(tmp_path, "iold", None))
    # What an older server wrote: the random token itself.
    store.db.execute("UPDATE sandboxes SET envd_token = 'Zm9vYmFyLXJhbmRvbS10b2tlbg'")
    got = store.get_sandbox("iold")
    assert got is not None and got.envd_token == "Zm9vYmFyLXJhbmRvbS10b2tlbg"
    store.close()


async def test_fork_children_get_tokens_of_their_own(node: Node) -> None:
    parent = await node.orchestrator.create(FAKE_TEMPLATE, secure=True)
    children = await node.orchestrator.fork(parent.sandbox_id, 2, None)
    tokens = node.orchestrator.store.tokens
    seen = {parent.record.envd_token}
    for child in children:
        assert not isinstance(child, Exception)
        assert child.record.envd_token == tokens.token(child.sandbox_id)
        seen.add(child.record.envd_token)
    assert len(seen) == 3


# -- data directory permissions ------------------------------------------------------------


def test_start_up_pass_makes_the_data_directory_private(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "sandboxes" / "ia").mkdir(parents=True)
    (home / "oci" / "tree" / "tmp").mkdir(parents=True)
    os.chmod(home, 0o755)
    os.chmod(home / "sandboxes", 0o755)
    (home / "state.db").write_bytes(b"x")
    os.chmod(home / "state.db", 0o644)
    script = home / "sandboxes" / "ia" / "run"
    script.write_text("#!/bin/sh\n")
    os.chmod(script, 0o755)
    os.chmod(home / "oci" / "tree" / "tmp", 0o1777)
    os.chmod(home / "oci", 0o755)
    outside = tmp_path / "outside"
    outside.write_text("not the server's to change")
    os.chmod(outside, 0o644)
    (home / "link").symlink_to(outside)
    # What confined VMMs use and a restarted server must leave as it is: a running
    # VMM's jail tree (0711 directories) and a file given to the VMM group (0640).
    jail = home / "sandboxes" / ".jail-ia" / "templates"
    jail.mkdir(parents=True)
    for directory in (jail, jail.parent):
        os.chmod(directory, 0o711)
    given = home / "kernel"
    given.write_bytes(b"k")
    os.chown(given, 0, 1_000_000_000)
    os.chmod(given, 0o644)

    assert make_data_private(home) > 0
    assert stat.S_IMODE(jail.stat().st_mode) == 0o711
    assert stat.S_IMODE(jail.parent.stat().st_mode) == 0o711
    assert stat.S_IMODE(given.stat().st_mode) == 0o640  # the group keeps read
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "sandboxes").stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "state.db").stat().st_mode) == 0o600
    assert stat.S_IMODE(script.stat().st_mode) == 0o700  # the owner keeps execute
    assert stat.S_IMODE((home / "oci").stat().st_mode) == 0o700
    # A guest tree being built keeps its image's modes.
    assert stat.S_IMODE((home / "oci" / "tree" / "tmp").stat().st_mode) == 0o1777
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644  # links are not followed
    assert make_data_private(home) == 0


def test_guest_trees_do_not_take_the_servers_umask(tmp_path: Path) -> None:
    """The server runs with umask 077; directories it adds to an image's root tree
    (a scratch image has no /home) are still 0755 in the guest."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        prepare_rootfs(tmp_path)
    finally:
        os.umask(previous)
    for directory in ("home", "home/user", "etc", ".aenv"):
        assert stat.S_IMODE((tmp_path / directory).stat().st_mode) == 0o755, directory


# -- metadata, env vars, snapshot names --------------------------------------------------


def _create(**body: object) -> NewSandbox:
    return NewSandbox.model_validate({"templateID": "base", **body})


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"metadata": {"k\x00": "v"}}, "metadata", "only letters"),
        ({"metadata": {"k\x1b[31m": "v"}}, "metadata", "only letters"),
        ({"metadata": {"": "v"}}, "metadata", "1 to"),
        ({"metadata": {"k": "a\x00b"}}, "metadata", "control characters"),
        ({"metadata": {"k": "\x1b[2J"}}, "metadata", "control characters"),
        ({"metadata": {"k": "v" * 5_000_000}}, "metadata", "at most"),
        (
            {"metadata": {f"k{i}": "v" for i in range(MAX_METADATA_ENTRIES + 1)}},
            "metadata",
            "entries",
        ),
        (
            {"metadata": {f"k{i}": "v" * MAX_METADATA_VALUE_LENGTH for i in range(16)}},
            "metadata",
            f"{MAX_METADATA_BYTES} bytes",
        ),
        ({"envVars": {"1A": "v"}}, "envVars", "not a variable name"),
        ({"envVars": {"A=B": "v"}}, "envVars", "not a variable name"),
        ({"envVars": {"A B": "v"}}, "envVars", "not a variable name"),
        ({"envVars": {"A": "x\x00y"}}, "envVars", "control characters"),
        ({"envVars": {"A": "x" * 1_000_000}}, "envVars", "at most"),
        ({"envVars": {f"A{i}": "v" for i in range(MAX_ENV_VARS + 1)}}, "envVars", "variables"),
    ],
)
def test_metadata_and_env_var_limits(body: dict[str, object], field: str, says: str) -> None:
    with pytest.raises(ValidationError) as info:
        _create(**body)
    errors = info.value.errors()
    assert [e["loc"] for e in errors] == [(field,)]
    assert says in errors[0]["msg"]
    assert len(errors[0]["msg"]) < 300  # a huge value is not echoed back


def test_ordinary_metadata_and_env_vars_pass() -> None:
    body = _create(
        metadata={"suite": "e2b", "team/name": "x y ü", "user@host": "a:b", "k.v-1+2": ""},
        envVars={"PATH_EXTRA": "/x", "_A1": "two words", "PEM": "-----BEGIN-----\nabc\r\n\t"},
    )
    assert body.metadata["team/name"] == "x y ü" and body.env_vars["PEM"].endswith("\t")


@pytest.mark.parametrize("name", ["/x", "/", "//a"])
def test_snapshot_names_do_not_start_with_a_slash(name: str) -> None:
    with pytest.raises(ValidationError) as info:
        SnapshotRequest.model_validate({"name": name})
    assert info.value.errors()[0]["loc"] == ("name",)
    assert SnapshotRequest.model_validate({"name": "team/x"}).name == "team/x"


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    started = await start_node(tmp_path / "home", tmp_path / "repository")
    yield started
    await started.stop()


async def test_lookups_by_an_invalid_name_are_invalid_requests(node: Node) -> None:
    for key in ("/x", "a\x00b"):
        with pytest.raises(InvalidRequest):
            await node.orchestrator.get_snapshot(key)
        with pytest.raises(InvalidRequest):
            await node.orchestrator.create(key)


# -- free-space floor --------------------------------------------------------------------


def test_free_space_floor_setting() -> None:
    assert Config(free_space_floor="5%").free_space_floor_of(1000) == 50
    assert Config(free_space_floor="1G").free_space_floor_of(1) == 1 << 30
    assert Config().free_space_floor_of(1000) == 0
    for bad in ("lots", "0%", "150%", "-1G"):
        with pytest.raises(ConfigError, match="free_space_floor"):
            Config.load(env={}, free_space_floor=bad)


def test_envd_token_key_setting_is_checked_and_not_repeated() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={}, envd_token_key="not-hex-secret")
    assert "envd_token_key" in str(info.value) and "not-hex-secret" not in str(info.value)


async def test_below_the_floor_nothing_is_created_forked_or_snapshotted(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = await node.orchestrator.create(FAKE_TEMPLATE, secure=True)
    floored = node.config.with_overrides(free_space_floor="1000T")
    node.orchestrator._free_space.config = floored
    sandboxes = sorted(p.name for p in node.config.sandboxes_dir.iterdir())
    snapshots = sorted(p.name for p in node.config.snapshots_dir.iterdir())
    records = [r.sandbox_id for r in node.orchestrator.store.list_sandboxes()]
    with pytest.raises(BelowFreeSpaceFloor, match="create refused"):
        await node.orchestrator.create(FAKE_TEMPLATE)
    with pytest.raises(BelowFreeSpaceFloor, match="fork refused"):
        await node.orchestrator.fork(running.sandbox_id, 1, None)
    with pytest.raises(BelowFreeSpaceFloor, match="snapshot refused"):
        await node.orchestrator.snapshot(running.sandbox_id, "s1")
    assert sorted(p.name for p in node.config.sandboxes_dir.iterdir()) == sandboxes
    assert sorted(p.name for p in node.config.snapshots_dir.iterdir()) == snapshots
    assert [r.sandbox_id for r in node.orchestrator.store.list_sandboxes()] == records
    # Above it again, they work.
    node.orchestrator._free_space.config = node.config
    await node.orchestrator.snapshot(running.sandbox_id, "s1")
