"""SQLite records of sandboxes and templates under the data directory.

Every statement is a short local transaction, so calls are made directly from the event
loop; the database is opened in WAL mode so a crash never leaves a torn record.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS templates (
    template_id TEXT PRIMARY KEY,
    build_id TEXT NOT NULL,
    snapshot_dir TEXT NOT NULL,
    vmm TEXT NOT NULL,
    accel TEXT NOT NULL,
    vcpus INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL,
    disk_size_mib INTEGER NOT NULL,
    envd_version TEXT NOT NULL,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id TEXT PRIMARY KEY,
    template_id TEXT NOT NULL,
    template_build_id TEXT NOT NULL,
    state TEXT NOT NULL,
    slot INTEGER NOT NULL UNIQUE,
    workdir TEXT NOT NULL,
    started_at TEXT NOT NULL,
    end_at TEXT NOT NULL,
    vcpus INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL,
    disk_size_mib INTEGER NOT NULL,
    envd_version TEXT NOT NULL,
    envd_token TEXT,
    metadata TEXT NOT NULL,
    env_vars TEXT NOT NULL,
    auto_pause INTEGER NOT NULL DEFAULT 0,
    allow_internet INTEGER NOT NULL DEFAULT 0
);
"""


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass
class TemplateRecord:
    template_id: str
    build_id: str
    snapshot_dir: Path
    vmm: str
    accel: str
    vcpus: int
    memory_mib: int
    disk_size_mib: int
    envd_version: str
    created_at: datetime


@dataclass
class SandboxRecord:
    sandbox_id: str
    template_id: str
    template_build_id: str
    state: str
    slot: int
    workdir: Path
    started_at: datetime
    end_at: datetime
    vcpus: int
    memory_mib: int
    disk_size_mib: int
    envd_version: str
    envd_token: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    allow_internet: bool = False


class Store:
    """Sandbox and template records. Not thread-safe: used from the event loop only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        db.execute(
            "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
            (str(SCHEMA_VERSION),),
        )
        self._db = db

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("store is not open")
        return self._db

    # -- templates ----------------------------------------------------------------------
    def put_template(self, rec: TemplateRecord) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO templates VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                rec.template_id,
                rec.build_id,
                str(rec.snapshot_dir),
                rec.vmm,
                rec.accel,
                rec.vcpus,
                rec.memory_mib,
                rec.disk_size_mib,
                rec.envd_version,
                rec.created_at.isoformat(),
            ),
        )

    def get_template(self, template_id: str) -> TemplateRecord | None:
        row = self.db.execute(
            "SELECT * FROM templates WHERE template_id = ?", (template_id,)
        ).fetchone()
        return _template(row) if row else None

    def list_templates(self) -> list[TemplateRecord]:
        return [_template(r) for r in self.db.execute("SELECT * FROM templates")]

    # -- sandboxes ----------------------------------------------------------------------
    def insert_sandbox(self, rec: SandboxRecord) -> None:
        self.db.execute(
            "INSERT INTO sandboxes VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                rec.sandbox_id,
                rec.template_id,
                rec.template_build_id,
                rec.state,
                rec.slot,
                str(rec.workdir),
                rec.started_at.isoformat(),
                rec.end_at.isoformat(),
                rec.vcpus,
                rec.memory_mib,
                rec.disk_size_mib,
                rec.envd_version,
                rec.envd_token,
                json.dumps(rec.metadata),
                json.dumps(rec.env_vars),
                int(rec.auto_pause),
                int(rec.allow_internet),
            ),
        )

    def update_sandbox(self, sandbox_id: str, **changes: Any) -> None:
        if not changes:
            return
        columns = []
        values: list[Any] = []
        for key, value in changes.items():
            columns.append(f"{key} = ?")
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, dict):
                value = json.dumps(value)
            elif isinstance(value, Path):
                value = str(value)
            values.append(value)
        values.append(sandbox_id)
        self.db.execute(
            f"UPDATE sandboxes SET {', '.join(columns)} WHERE sandbox_id = ?",
            values,
        )

    def delete_sandbox(self, sandbox_id: str) -> None:
        self.db.execute("DELETE FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,))

    def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        row = self.db.execute(
            "SELECT * FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,)
        ).fetchone()
        return _sandbox(row) if row else None

    def list_sandboxes(self) -> list[SandboxRecord]:
        rows = self.db.execute("SELECT * FROM sandboxes ORDER BY started_at, sandbox_id")
        return [_sandbox(r) for r in rows]

    def used_slots(self) -> set[int]:
        return {int(r[0]) for r in self.db.execute("SELECT slot FROM sandboxes")}


def _template(row: sqlite3.Row) -> TemplateRecord:
    return TemplateRecord(
        template_id=row["template_id"],
        build_id=row["build_id"],
        snapshot_dir=Path(row["snapshot_dir"]),
        vmm=row["vmm"],
        accel=row["accel"],
        vcpus=row["vcpus"],
        memory_mib=row["memory_mib"],
        disk_size_mib=row["disk_size_mib"],
        envd_version=row["envd_version"],
        created_at=datetime.fromisoformat(row["created_at"]),
    )


def _sandbox(row: sqlite3.Row) -> SandboxRecord:
    return SandboxRecord(
        sandbox_id=row["sandbox_id"],
        template_id=row["template_id"],
        template_build_id=row["template_build_id"],
        state=row["state"],
        slot=row["slot"],
        workdir=Path(row["workdir"]),
        started_at=datetime.fromisoformat(row["started_at"]),
        end_at=datetime.fromisoformat(row["end_at"]),
        vcpus=row["vcpus"],
        memory_mib=row["memory_mib"],
        disk_size_mib=row["disk_size_mib"],
        envd_version=row["envd_version"],
        envd_token=row["envd_token"],
        metadata=json.loads(row["metadata"]),
        env_vars=json.loads(row["env_vars"]),
        auto_pause=bool(row["auto_pause"]),
        allow_internet=bool(row["allow_internet"]),
    )
