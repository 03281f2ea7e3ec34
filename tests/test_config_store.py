"""Pure-logic tests: configuration loading and the SQLite store."""

from __future__ import annotations

import os
import stat
from datetime import timedelta
from pathlib import Path

import pytest

from agentenv.config import Config, ConfigError
from agentenv.orchestrator.states import SandboxState
from agentenv.orchestrator.store import SandboxRecord, Store, utcnow


def test_env_overrides_file(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('listen = "0.0.0.0:9000"\nvcpus = 4\n')
    config = Config.load(env={"AENV_HOME": str(tmp_path), "AENV_VCPUS": "1"})
    assert config.listen == "0.0.0.0:9000"
    assert config.vcpus == 1
    assert config.port == 9000 and config.host == "0.0.0.0"


def test_bad_values_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="listen"):
        Config.load(env={"AENV_HOME": str(tmp_path), "AENV_LISTEN": "nohost"})
    with pytest.raises(ConfigError, match="vcpus"):
        Config.load(env={"AENV_HOME": str(tmp_path), "AENV_VCPUS": "many"})
    with pytest.raises(ConfigError, match="vmm"):
        Config.load(env={"AENV_HOME": str(tmp_path), "AENV_VMM": "bochs"})
    with pytest.raises(ConfigError, match="sandbox_memory"):
        Config.load(env={"AENV_HOME": str(tmp_path), "AENV_SANDBOX_MEMORY": "swap"})
    with pytest.raises(ConfigError, match="network_linger"):
        Config.load(env={"AENV_HOME": str(tmp_path), "AENV_NETWORK_LINGER": "soon"})
    (tmp_path / "config.toml").write_text("listen = [")
    with pytest.raises(ConfigError, match=r"config\.toml"):
        Config.load(env={"AENV_HOME": str(tmp_path)})


def test_api_key_generated_once_with_private_mode(tmp_path: Path) -> None:
    config = Config.load(env={"AENV_HOME": str(tmp_path)})
    key = config.ensure_api_key()
    assert key.startswith("e2b_")
    assert stat.S_IMODE(os.stat(config.api_key_path).st_mode) == 0o600
    assert config.ensure_api_key() == key
    explicit = Config.load(env={"AENV_HOME": str(tmp_path), "AENV_API_KEY": "e2b_mine"})
    assert explicit.ensure_api_key() == "e2b_mine"


def test_side_by_side_servers_get_distinct_names(tmp_path: Path) -> None:
    a = Config.load(env={"AENV_HOME": str(tmp_path / "a")})
    b = Config.load(env={"AENV_HOME": str(tmp_path / "b")})
    assert a.instance_tag != b.instance_tag


def test_store_round_trip(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.open()
    now = utcnow()
    rec = SandboxRecord(
        sandbox_id="iabc",
        template_id="base",
        template_build_id="b1",
        state=SandboxState.RUNNING,
        slot=3,
        workdir=tmp_path / "iabc",
        started_at=now,
        end_at=now + timedelta(seconds=5),
        vcpus=2,
        memory_mib=512,
        disk_size_mib=4096,
        envd_version="0.2.0",
        metadata={"k": "v"},
        env_vars={"A": "1"},
    )
    store.insert_sandbox(rec)
    store.transition("iabc", SandboxState.RUNNING, SandboxState.PAUSING, metadata={"k": "w"})
    store.close()
    store.open()  # survives reopening
    loaded = store.get_sandbox("iabc")
    assert loaded is not None
    assert loaded.state == "pausing" and loaded.metadata == {"k": "w"}
    assert loaded.end_at == rec.end_at
    assert store.used_slots() == {3}
    store.delete_sandbox("iabc")
    assert store.get_sandbox("iabc") is None


def test_store_migrates_a_version_1_database(tmp_path: Path) -> None:
    """A data directory from before snapshots keeps its sandboxes: the new columns are
    added with defaults when the store opens it."""
    import sqlite3

    db = sqlite3.connect(tmp_path / "state.db")
    db.executescript(
        "CREATE TABLE sandboxes (sandbox_id TEXT PRIMARY KEY, template_id TEXT NOT NULL,"
        " template_build_id TEXT NOT NULL, state TEXT NOT NULL, slot INTEGER NOT NULL UNIQUE,"
        " workdir TEXT NOT NULL, started_at TEXT NOT NULL, end_at TEXT NOT NULL,"
        " vcpus INTEGER NOT NULL, memory_mib INTEGER NOT NULL, disk_size_mib INTEGER NOT NULL,"
        " envd_version TEXT NOT NULL, envd_token TEXT, metadata TEXT NOT NULL,"
        " env_vars TEXT NOT NULL, auto_pause INTEGER NOT NULL DEFAULT 0,"
        " allow_internet INTEGER NOT NULL DEFAULT 0);"
        "INSERT INTO sandboxes VALUES ('iold', 'base', 'b1', 'paused', 0, '/x',"
        " '2026-01-01T00:00:00+00:00', '2026-01-01T00:00:00+00:00', 1, 512, 1, '0.6.4',"
        " NULL, '{}', '{}', 0, 0);"
    )
    db.close()
    store = Store(tmp_path / "state.db")
    store.open()
    old = store.get_sandbox("iold")
    assert old is not None
    assert (old.state, old.memory_mode, old.disk_path, old.parent_id) == (
        "paused",
        "private",
        None,
        None,
    )
    assert store.list_snapshots() == []
    store.close()


@pytest.mark.parametrize(
    ("stored", "shown"),
    [("running", "running"), ("pausing", "running"), ("paused", "paused"), ("resuming", "paused")],
)
def test_transitions_show_the_state_being_left(tmp_path: Path, stored: str, shown: str) -> None:
    from agentenv.orchestrator.states import VISIBLE_STATES
    from agentenv.orchestrator.views import SandboxView

    now = utcnow()
    rec = SandboxRecord(
        sandbox_id="iabc",
        template_id="base",
        template_build_id="b1",
        state=SandboxState(stored),
        slot=0,
        workdir=tmp_path,
        started_at=now,
        end_at=now,
        vcpus=1,
        memory_mib=512,
        disk_size_mib=1,
        envd_version="0.6.4",
    )
    assert stored in VISIBLE_STATES
    assert SandboxView(rec, "10.0.0.2").state == shown
