"""Pure-logic tests: configuration loading and the SQLite store."""

from __future__ import annotations

import os
import stat
from datetime import timedelta
from pathlib import Path

import pytest

from agentenv.config import Config, ConfigError
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
        state="running",
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
    store.update_sandbox("iabc", state="paused", metadata={"k": "w"})
    store.close()
    store.open()  # survives reopening
    loaded = store.get_sandbox("iabc")
    assert loaded is not None
    assert loaded.state == "paused" and loaded.metadata == {"k": "w"}
    assert loaded.end_at == rec.end_at
    assert store.used_slots() == {3}
    store.delete_sandbox("iabc")
    assert store.get_sandbox("iabc") is None


@pytest.mark.parametrize(
    ("stored", "shown"),
    [("running", "running"), ("pausing", "running"), ("paused", "paused"), ("resuming", "paused")],
)
def test_transitions_show_the_state_being_left(tmp_path: Path, stored: str, shown: str) -> None:
    from agentenv.orchestrator.orchestrator import VISIBLE_STATES, SandboxView

    now = utcnow()
    rec = SandboxRecord(
        sandbox_id="iabc",
        template_id="base",
        template_build_id="b1",
        state=stored,
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
