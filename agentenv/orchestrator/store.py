"""SQLite records of sandboxes, snapshots and templates under the data directory.

Every statement is a short local transaction, so calls are made directly from the event
loop; the database is opened in WAL mode so a crash never leaves a torn record. A
sandbox's state changes only through :meth:`Store.transition`, a compare-and-set that
refuses what the state machine (:mod:`.states`) does not allow; it is also where
lifecycle events are emitted, to the listeners added with :meth:`Store.listen`.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agentenv.network.policy import EgressPolicy
from agentenv.orchestrator.network_options import NetworkOptions
from agentenv.orchestrator.states import IllegalTransition, SandboxState, StateChanged, allowed
from agentenv.orchestrator.tokens import KEY_FILE, EnvdTokens, TokenKeyMismatch, token_digest

log = logging.getLogger("agentenv.orchestrator")

SCHEMA_VERSION = 2

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
CREATE TABLE IF NOT EXISTS snapshots (
    snapshot_id TEXT PRIMARY KEY,
    name TEXT UNIQUE,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    template_id TEXT NOT NULL,
    parent_id TEXT,
    snapshot_dir TEXT NOT NULL,
    metadata TEXT NOT NULL,
    created_at TEXT NOT NULL
);
"""

# Columns added after schema version 1: (name, declaration). Added to an older database on
# open, so a data directory survives the upgrade.
_SANDBOX_COLUMNS_V2 = (
    ("memory_mode", "TEXT NOT NULL DEFAULT 'private'"),
    ("disk_path", "TEXT"),
    ("source_dir", "TEXT"),
    ("parent_id", "TEXT"),
    ("snapshot_id", "TEXT"),
    ("auto_resume", "INTEGER NOT NULL DEFAULT 0"),
    ("pause_mode", "TEXT"),
)
# The sandbox's network options (NetworkOptions JSON) and traffic access token. Rows
# written before them get the options their allow_internet column meant (Store.open).
_SANDBOX_NETWORK_COLUMNS = (
    ("network", "TEXT"),
    ("traffic_token", "TEXT"),
)
# The volumes a sandbox mounts (JSON list of VolumeMount); NULL: none.
_SANDBOX_VOLUME_COLUMNS = (("volumes", "TEXT"),)
# The envd /init a running sandbox is still owed ("start" or "resume"); NULL: none.
_SANDBOX_ENVD_COLUMNS = (("envd_pending", "TEXT"),)


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
class SnapshotRecord:
    """A persistent snapshot (``kind='snapshot'``) or the frozen parent image of a fork
    (``kind='fork'``, never listed). ``state`` is ``pending`` while it is being taken,
    ``ready``, or ``deleted`` (hidden; its files go once nothing uses them)."""

    snapshot_id: str
    name: str | None
    kind: str
    state: str
    sandbox_id: str
    template_id: str
    parent_id: str | None
    snapshot_dir: Path
    metadata: dict[str, str]
    created_at: datetime


@dataclass(frozen=True)
class VolumeMount:
    """A volume mounted in a sandbox: at ``path`` in the guest, from volume slot
    ``slot`` of its machine (see :mod:`agentenv.orchestrator.volumes`)."""

    volume_id: str
    name: str
    path: str
    slot: int


@dataclass
class SandboxRecord:
    sandbox_id: str
    template_id: str
    template_build_id: str
    state: SandboxState
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
    network: NetworkOptions = field(default_factory=NetworkOptions)
    traffic_token: str | None = None
    # "shared": RAM is the file memory.raw in workdir (saved by device state alone);
    # "private": a copy-on-write mapping of source_dir's RAM image.
    memory_mode: str = "private"
    disk_path: Path | None = None
    # The machine snapshot (template, snapshot or fork image) this sandbox started from.
    source_dir: Path | None = None
    parent_id: str | None = None
    snapshot_id: str | None = None
    auto_resume: bool = False
    pause_mode: str | None = None
    volumes: tuple[VolumeMount, ...] = ()
    # The envd /init this running sandbox still awaits: "start" (its envd has no token
    # of its own yet) or "resume"; None once done. A server killed before it finished
    # runs it again when it re-adopts the sandbox.
    envd_pending: str | None = None


@dataclass(frozen=True)
class SandboxEvent:
    """A sandbox entered state ``new`` (None: its record is gone) from ``old`` (None:
    it was just recorded)."""

    sandbox_id: str
    old: SandboxState | None
    new: SandboxState | None
    at: datetime


SandboxListener = Callable[[SandboxEvent], None]


class Store:
    """Sandbox and template records. Not thread-safe: used from the event loop only.
    ``path`` ``None`` keeps them in memory (tests).

    A sandbox's ``envd_token`` is not written: the record keeps its digest and reading
    it derives the token again with :attr:`tokens` (:mod:`.tokens`), whose key is
    :data:`~.tokens.KEY_FILE` next to the database (``tokens`` given: that one)."""

    def __init__(self, path: Path | None, tokens: EnvdTokens | None = None) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None
        self._listeners: list[SandboxListener] = []
        self._tokens = tokens

    def listen(self, listener: SandboxListener) -> None:
        """Call ``listener`` on every sandbox state change, after it is written.
        Listeners must be quick and must not raise."""
        self._listeners.append(listener)

    def _emit(self, sandbox_id: str, old: SandboxState | None, new: SandboxState | None) -> None:
        event = SandboxEvent(sandbox_id, old, new, utcnow())
        for listener in self._listeners:
            listener(event)

    def open(self) -> None:
        if self.path is None:
            db = sqlite3.connect(":memory:", isolation_level=None)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        have = {r["name"] for r in db.execute("PRAGMA table_info(sandboxes)")}
        for name, decl in _SANDBOX_COLUMNS_V2:
            if name not in have:
                db.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {decl}")
        for name, decl in (
            *_SANDBOX_NETWORK_COLUMNS,
            *_SANDBOX_VOLUME_COLUMNS,
            *_SANDBOX_ENVD_COLUMNS,
        ):
            if name not in have:
                db.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {decl}")
        for allow_internet in (False, True):
            options = NetworkOptions(EgressPolicy(allow_internet=allow_internet))
            db.execute(
                "UPDATE sandboxes SET network = ? WHERE network IS NULL AND allow_internet = ?",
                (json.dumps(options.to_dict()), int(allow_internet)),
            )
        db.execute(
            "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
            (str(SCHEMA_VERSION),),
        )
        self._db = db
        if self._tokens is None:
            self._tokens = (
                EnvdTokens.load(self.path.parent / KEY_FILE)
                if self.path is not None
                else EnvdTokens(os.urandom(32))
            )

    @property
    def tokens(self) -> EnvdTokens:
        """Derives sandboxes' envd tokens (set once the store is open)."""
        if self._tokens is None:
            raise RuntimeError("store is not open")
        return self._tokens

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
        row = _sandbox_row(rec)
        row["envd_token"] = self.tokens.stored(rec.sandbox_id, rec.envd_token)
        row["traffic_token"] = token_digest(rec.traffic_token) if rec.traffic_token else None
        names = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        self.db.execute(f"INSERT INTO sandboxes ({names}) VALUES ({marks})", list(row.values()))
        self._emit(rec.sandbox_id, None, rec.state)

    def update_sandbox(self, sandbox_id: str, **changes: Any) -> None:
        """Change fields of a sandbox's record other than its state."""
        if "state" in changes:
            raise ValueError("a sandbox's state changes only through Store.transition")
        if changes:
            self._update(sandbox_id, changes, None)

    def set_network(self, sandbox_id: str, options: NetworkOptions) -> None:
        """Replace a sandbox's network options (``PUT /sandboxes/{id}/network``)."""
        self._update(
            sandbox_id,
            {
                "network": options.to_dict(),
                "allow_internet": int(options.egress.allow_internet),
            },
            None,
        )

    def transition(
        self,
        sandbox_id: str,
        expected: SandboxState,
        new: SandboxState,
        **changes: Any,
    ) -> None:
        """Move a sandbox from state ``expected`` to ``new``, with other field
        ``changes`` in the same write. :class:`IllegalTransition` if the state machine
        has no such edge; :class:`StateChanged` if the record is not in ``expected``
        (another operation moved it, or it is gone)."""
        if not allowed(expected, new):
            raise IllegalTransition(sandbox_id, expected, new)
        if not self._update(sandbox_id, {**changes, "state": new.value}, expected):
            current = self.get_sandbox(sandbox_id)
            raise StateChanged(sandbox_id, expected, current.state if current else None)
        self._emit(sandbox_id, expected, new)

    def _update(
        self, sandbox_id: str, changes: dict[str, Any], expected: SandboxState | None
    ) -> bool:
        columns = []
        values: list[Any] = []
        if "envd_token" in changes:
            changes = {
                **changes,
                "envd_token": self.tokens.stored(sandbox_id, changes["envd_token"]),
            }
        if changes.get("traffic_token"):
            changes = {**changes, "traffic_token": token_digest(changes["traffic_token"])}
        for key, value in changes.items():
            columns.append(f"{key} = ?")
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, dict):
                value = json.dumps(value)
            elif isinstance(value, Path):
                value = str(value)
            values.append(value)
        where = "sandbox_id = ?"
        values.append(sandbox_id)
        if expected is not None:
            where += " AND state = ?"
            values.append(expected.value)
        cursor = self.db.execute(f"UPDATE sandboxes SET {', '.join(columns)} WHERE {where}", values)
        return cursor.rowcount == 1

    def delete_sandbox(self, sandbox_id: str) -> None:
        row = self.db.execute(
            "DELETE FROM sandboxes WHERE sandbox_id = ? RETURNING state", (sandbox_id,)
        ).fetchone()
        if row is not None:
            self._emit(sandbox_id, SandboxState(row[0]), None)

    def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        row = self.db.execute(
            "SELECT * FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,)
        ).fetchone()
        return self._sandbox(row) if row else None

    def list_sandboxes(self) -> list[SandboxRecord]:
        rows = self.db.execute("SELECT * FROM sandboxes ORDER BY started_at, sandbox_id")
        return [self._sandbox(r) for r in rows]

    def _sandbox(self, row: sqlite3.Row) -> SandboxRecord:
        rec = _sandbox(row)
        try:
            rec.envd_token = self.tokens.restored(rec.sandbox_id, rec.envd_token)
        except TokenKeyMismatch as exc:
            # Its guest holds a token this node cannot reproduce: calls to its envd will
            # be refused, which is the failure the log line explains.
            log.error("%s", exc)
            rec.envd_token = self.tokens.token(rec.sandbox_id)
        try:
            rec.traffic_token = self.tokens.restored_traffic(rec.sandbox_id, rec.traffic_token)
        except TokenKeyMismatch as exc:
            log.error("%s", exc)
            rec.traffic_token = self.tokens.traffic_token(rec.sandbox_id)
        return rec

    def used_slots(self) -> set[int]:
        return {int(r[0]) for r in self.db.execute("SELECT slot FROM sandboxes")}

    # -- snapshots ----------------------------------------------------------------------
    def insert_snapshot(self, rec: SnapshotRecord) -> None:
        self.db.execute(
            "INSERT INTO snapshots (snapshot_id, name, kind, state, sandbox_id, template_id,"
            " parent_id, snapshot_dir, metadata, created_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                rec.snapshot_id,
                rec.name,
                rec.kind,
                rec.state,
                rec.sandbox_id,
                rec.template_id,
                rec.parent_id,
                str(rec.snapshot_dir),
                json.dumps(rec.metadata),
                rec.created_at.isoformat(),
            ),
        )

    def get_snapshot(self, key: str) -> SnapshotRecord | None:
        """A snapshot by id or by name."""
        row = self.db.execute(
            "SELECT * FROM snapshots WHERE snapshot_id = ? OR name = ?", (key, key)
        ).fetchone()
        return _snapshot(row) if row else None

    def list_snapshots(self) -> list[SnapshotRecord]:
        rows = self.db.execute("SELECT * FROM snapshots ORDER BY created_at, snapshot_id")
        return [_snapshot(r) for r in rows]

    def update_snapshot(self, snapshot_id: str, **changes: Any) -> None:
        columns = ", ".join(f"{k} = ?" for k in changes)
        self.db.execute(
            f"UPDATE snapshots SET {columns} WHERE snapshot_id = ?",
            [*changes.values(), snapshot_id],
        )

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.db.execute("DELETE FROM snapshots WHERE snapshot_id = ?", (snapshot_id,))


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


def _snapshot(row: sqlite3.Row) -> SnapshotRecord:
    return SnapshotRecord(
        snapshot_id=row["snapshot_id"],
        name=row["name"],
        kind=row["kind"],
        state=row["state"],
        sandbox_id=row["sandbox_id"],
        template_id=row["template_id"],
        parent_id=row["parent_id"],
        snapshot_dir=Path(row["snapshot_dir"]),
        metadata=json.loads(row["metadata"]),
        created_at=datetime.fromisoformat(row["created_at"]),
    )


def _sandbox_row(rec: SandboxRecord) -> dict[str, Any]:
    return {
        "sandbox_id": rec.sandbox_id,
        "template_id": rec.template_id,
        "template_build_id": rec.template_build_id,
        "state": rec.state.value,
        "slot": rec.slot,
        "workdir": str(rec.workdir),
        "started_at": rec.started_at.isoformat(),
        "end_at": rec.end_at.isoformat(),
        "vcpus": rec.vcpus,
        "memory_mib": rec.memory_mib,
        "disk_size_mib": rec.disk_size_mib,
        "envd_version": rec.envd_version,
        "envd_token": rec.envd_token,
        "metadata": json.dumps(rec.metadata),
        "env_vars": json.dumps(rec.env_vars),
        "auto_pause": int(rec.auto_pause),
        # Kept for servers that predate the network column.
        "allow_internet": int(rec.network.egress.allow_internet),
        "network": json.dumps(rec.network.to_dict()),
        "traffic_token": rec.traffic_token,
        "memory_mode": rec.memory_mode,
        "disk_path": str(rec.disk_path) if rec.disk_path else None,
        "source_dir": str(rec.source_dir) if rec.source_dir else None,
        "parent_id": rec.parent_id,
        "snapshot_id": rec.snapshot_id,
        "auto_resume": int(rec.auto_resume),
        "pause_mode": rec.pause_mode,
        "volumes": json.dumps([asdict(m) for m in rec.volumes]) if rec.volumes else None,
        "envd_pending": rec.envd_pending,
    }


def _sandbox(row: sqlite3.Row) -> SandboxRecord:
    return SandboxRecord(
        sandbox_id=row["sandbox_id"],
        template_id=row["template_id"],
        template_build_id=row["template_build_id"],
        state=SandboxState(row["state"]),
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
        network=_network_options(row["network"], bool(row["allow_internet"])),
        traffic_token=row["traffic_token"],
        memory_mode=row["memory_mode"],
        disk_path=Path(row["disk_path"]) if row["disk_path"] else None,
        source_dir=Path(row["source_dir"]) if row["source_dir"] else None,
        parent_id=row["parent_id"],
        snapshot_id=row["snapshot_id"],
        auto_resume=bool(row["auto_resume"]),
        pause_mode=row["pause_mode"],
        volumes=tuple(VolumeMount(**m) for m in json.loads(row["volumes"] or "[]")),
        envd_pending=row["envd_pending"],
    )


def _network_options(stored: str | None, allow_internet: bool) -> NetworkOptions:
    if stored is None:  # written by an older server since this one opened the store
        return NetworkOptions(EgressPolicy(allow_internet=allow_internet))
    return NetworkOptions.from_dict(json.loads(stored))
