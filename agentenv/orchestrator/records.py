"""The records nodes exchange through the snapshot repository, typed and versioned.

A node reads records other nodes (possibly older or newer servers) wrote, so: every
record carries ``version``; a record without one is version 1 (written before records
had it); fields a reader does not know are ignored, and fields added later must have
defaults. The JSON written is exactly the fields below, so older readers that look keys
up by name keep working.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

RECORD_VERSION = 1


class MalformedRecord(ValueError):
    """A repository record that does not parse as its type."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    version: int = RECORD_VERSION

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Self:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            what = data.get("id") or data.get("sandbox_id") or "?"
            raise MalformedRecord(f"{cls.__name__} {what}: {exc}") from exc

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class SnapshotEntry(_Record):
    """A committed snapshot or template (``catalog/snapshot/<id>``)."""

    id: str
    type: str = "snapshot"
    names: list[str] = Field(default_factory=list)
    sandbox_id: str = ""
    template_id: str = ""
    parent_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    created_at: datetime
    # The node that committed it.
    node: str = ""
    vcpus: int
    memory_mib: int
    disk_size_mib: int
    envd_version: str
    # The snapshot's portable description and the blobs it references (snapshots/).
    manifest: dict[str, Any]
    blobs: dict[str, str]
    # The sandbox's envd token's digest (tokens.token_digest): the node resuming it
    # derives the token with its key and checks it against this.
    envd_token_sha256: str | None = None


class PausedEntry(_Record):
    """A sandbox paused on some node, resumable on any (``catalog/paused/<id>``):
    generation ``generation`` of it, held by whoever claims that generation first."""

    sandbox_id: str
    generation: int
    node: str = ""
    template_id: str
    template_build_id: str
    snapshot_id: str | None = None
    parent_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict)
    # Written only for a token from before envd tokens were derived from the node key
    # (orchestrator/tokens.py); records from older nodes carry every token here.
    envd_token: str | None = None
    auto_pause: bool = False
    auto_resume: bool = False
    allow_internet: bool = False
    # NetworkOptions.to_dict(); absent in records written before it (allow_internet
    # then says everything there is to know).
    network: dict[str, Any] | None = None
    # The traffic access token's digest (tokens.token_digest): the resuming node derives
    # the token and checks it against this.
    traffic_token_sha256: str | None = None
    envd_version: str
    started_at: datetime
    end_at: datetime
    paused_at: datetime
    manifest: dict[str, Any]
    blobs: dict[str, str]
    # The sandbox's envd token's digest (tokens.token_digest): the node resuming it
    # derives the token with its key and checks it against this.
    envd_token_sha256: str | None = None


class PendingPause(_Record):
    """A pause whose commit has not landed yet (``catalog/pausing/<id>``): written by
    the pausing node before its pause answers, so a node asked to connect the sandbox
    meanwhile waits for generation ``generation`` instead of answering 404. Stale once
    a paused record of that generation (or a later one) exists, or once removed (the
    pausing node resumed or killed the sandbox before committing it)."""

    sandbox_id: str
    generation: int
    node: str
    paused_at: datetime


class TagEntry(_Record):
    """A tag of a template name pointing at one of its builds
    (``catalog/tags/<name>/<tag>``). The ``default`` tag is not one of these: it is the
    name itself (``catalog/names/<name>``), which is what older nodes resolve."""

    name: str
    tag: str
    # The build's record id (``catalog/snapshot/<target>``).
    target: str
    assigned_at: datetime


class SecretEntry(_Record):
    """A secret of the E2B secrets API (``catalog/secret/<id>``; its name is the
    repository name ``secret:<name>``). Only the current version's value is kept, and
    only encrypted (``orchestrator/secrets.py``): AES-256-GCM under the nodes' secrets
    key, which never enters the repository; ``key_id`` tells which key it was."""

    id: str
    name: str
    current_version: int
    metadata: dict[str, str] = Field(default_factory=dict)
    created_at: datetime
    updated_at: datetime
    node: str = ""
    key_id: str
    nonce: str  # base64
    ciphertext: str  # base64, the GCM tag included


class VolumeEntry(_Record):
    """A volume (``catalog/volume/<id>``; its name is ``volume:<name>`` among the
    repository's names). Its current image is ``blobs["image"]`` in the repository when
    ``node`` is empty, else the local image of node ``node``, which has the writer's
    claim (``claim:volume:<id>``) and publishes it when it lets go (see
    :mod:`agentenv.orchestrator.volumes`); ``token`` authorises the content API, and is
    given to whoever may read the volume's record (the API key holder)."""

    id: str
    name: str
    token: str
    node: str
    created_at: datetime
    # {"image": digest} once published; the top-level "blobs" map is what the
    # repository's garbage collection keeps.
    blobs: dict[str, str] = Field(default_factory=dict)
