"""Request and response bodies: the API contract, in the field names E2B's SDK uses."""

from __future__ import annotations

import re
import unicodedata
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from agentenv.limits import (
    MAX_DNS_SERVERS,
    MAX_EGRESS_ENTRIES,
    MAX_EGRESS_ENTRY_LENGTH,
    MAX_ENV_VAR_NAME_LENGTH,
    MAX_ENV_VAR_VALUE_LENGTH,
    MAX_ENV_VARS,
    MAX_ENV_VARS_BYTES,
    MAX_FORK_CHILDREN,
    MAX_METADATA_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_METADATA_KEY_LENGTH,
    MAX_METADATA_VALUE_LENGTH,
    MAX_REFRESH_DURATION_S,
    MAX_SNAPSHOT_NAME_LENGTH,
    MAX_TEMPLATE_NAME_LENGTH,
    MAX_TEMPLATE_REF_LENGTH,
    TEMPLATE_REF_PATTERN,
)
from agentenv.orchestrator.tags import MAX_TAG_LENGTH

# Metadata keys end up in listings, query filters (``?metadata=k=v``) and logs: word
# characters and a few separators, nothing that needs quoting or escaping there.
_METADATA_KEY = re.compile(r"[\w.:/@+-]+")
# What a POSIX shell and env(1) accept as a variable name.
_ENV_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Multi-line values (certificates, keys) are ordinary in environment variables.
_ENV_VALUE_CONTROLS_ALLOWED = frozenset("\t\n\r")


# An allowOut / denyOut / dnsServers entry: an address, a network or a host name.
_EgressEntry = Annotated[str, StringConstraints(min_length=1, max_length=MAX_EGRESS_ENTRY_LENGTH)]
# Each entry is a rule in the sandbox's firewall or the host's egress filter.
_EgressList = Annotated[list[_EgressEntry], Field(max_length=MAX_EGRESS_ENTRIES)]
_DnsList = Annotated[list[_EgressEntry], Field(max_length=MAX_DNS_SERVERS)]


def _shown(text: str) -> str:
    """``text`` quoted for an error message, cut short (the value may be megabytes)."""
    quoted = repr(text)
    return quoted if len(quoted) <= 40 else quoted[:36] + "...'"


def _has_control(text: str, allowed: frozenset[str] = frozenset()) -> bool:
    return any(unicodedata.category(c) == "Cc" and c not in allowed for c in text)


def check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` if it is within the limits (:mod:`agentenv.limits`), else a
    ``ValueError`` saying which entry is not and why."""
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise ValueError(f"at most {MAX_METADATA_ENTRIES} entries, got {len(metadata)}")
    total = 0
    for key, value in metadata.items():
        if not 0 < len(key) <= MAX_METADATA_KEY_LENGTH:
            raise ValueError(f"key {_shown(key)}: 1 to {MAX_METADATA_KEY_LENGTH} characters")
        if not _METADATA_KEY.fullmatch(key):
            raise ValueError(
                f"key {_shown(key)}: only letters, digits and _ . : / @ + - are allowed"
            )
        if len(value) > MAX_METADATA_VALUE_LENGTH:
            raise ValueError(
                f"value of {key!r}: at most {MAX_METADATA_VALUE_LENGTH} characters, "
                f"got {len(value)}"
            )
        if _has_control(value):
            raise ValueError(
                f"value of {key!r}: control characters (NUL, ESC, ...) are not allowed"
            )
        total += len(key.encode()) + len(value.encode())
    if total > MAX_METADATA_BYTES:
        raise ValueError(
            f"keys and values together at most {MAX_METADATA_BYTES} bytes, got {total}"
        )
    return metadata


def check_env_vars(env_vars: dict[str, str]) -> dict[str, str]:
    """``env_vars`` if they are within the limits (:mod:`agentenv.limits`) and every
    name is a valid variable name, else a ``ValueError`` saying which is not and why."""
    if len(env_vars) > MAX_ENV_VARS:
        raise ValueError(f"at most {MAX_ENV_VARS} variables, got {len(env_vars)}")
    total = 0
    for name, value in env_vars.items():
        if len(name) > MAX_ENV_VAR_NAME_LENGTH:
            raise ValueError(f"name {_shown(name)}: at most {MAX_ENV_VAR_NAME_LENGTH} characters")
        if not _ENV_VAR_NAME.fullmatch(name):
            raise ValueError(
                f"name {_shown(name)}: not a variable name (letters, digits and _, "
                "not starting with a digit)"
            )
        if len(value) > MAX_ENV_VAR_VALUE_LENGTH:
            raise ValueError(
                f"value of {name}: at most {MAX_ENV_VAR_VALUE_LENGTH} characters, got {len(value)}"
            )
        if _has_control(value, _ENV_VALUE_CONTROLS_ALLOWED):
            raise ValueError(
                f"value of {name}: control characters other than tab and line breaks "
                "(NUL, ESC, ...) are not allowed"
            )
        total += len(name.encode()) + len(value.encode())
    if total > MAX_ENV_VARS_BYTES:
        raise ValueError(
            f"names and values together at most {MAX_ENV_VARS_BYTES} bytes, got {total}"
        )
    return env_vars


# Timeouts are sandbox lifetimes: 0 would end the sandbox at once (E2B's API answers a
# resume or fork asking for it with 400 "Timeout must be greater than 0"); DELETE kills.
_LIFETIME = (
    "seconds until the sandbox times out (killed, or paused with autoPause); at least 1, "
    "at most the server's AENV_MAX_TIMEOUT"
)


class ErrorBody(BaseModel):
    code: int
    message: str
    # What failed, for a caller that acts on it (the orchestrator's ErrorCode, e.g.
    # "mode_mismatch": saved under another VMM/accelerator, which a node of that mode
    # can restore); absent on errors the API answers itself.
    error_code: str | None = None


class VolumeMountBody(BaseModel):
    """A volume mounted in a sandbox: ``name`` at ``path``."""

    name: str = Field(min_length=1, max_length=63)
    path: str = Field(min_length=2, max_length=1024)


class NewVolume(BaseModel):
    """Body of ``POST /volumes``."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


class VolumeInfo(BaseModel):
    """A volume, as ``GET /volumes`` lists it."""

    model_config = ConfigDict(populate_by_name=True)

    volume_id: str = Field(alias="volumeID")
    name: str


class VolumeAndToken(VolumeInfo):
    """A volume with the token its content API takes (``Authorization: Bearer``)."""

    token: str


class VolumeMetadataUpdate(BaseModel):
    """Body of ``PATCH /volumecontent/{id}/path``."""

    uid: int | None = Field(default=None, ge=0, le=0xFFFFFFFE)
    gid: int | None = Field(default=None, ge=0, le=0xFFFFFFFE)
    mode: int | None = Field(default=None, ge=0, le=0o7777)


class VolumeEntryStat(BaseModel):
    """A file or directory of a volume."""

    name: str
    type: str
    path: str
    size: int
    mode: int
    uid: int
    gid: int
    atime: datetime
    mtime: datetime
    ctime: datetime
    target: str | None = None


class NewSandbox(BaseModel):
    """Body of ``POST /sandboxes`` and ``POST /v2/sandboxes``. Unknown top-level fields
    (mcp, ...) are accepted and ignored so newer SDKs keep working;
    ``network`` is read whole, and what of it is not supported is refused by name."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    template_id: str = Field(
        alias="templateID",
        min_length=1,
        max_length=MAX_TEMPLATE_REF_LENGTH,
        pattern=TEMPLATE_REF_PATTERN,
        description="a template's or snapshot's id or name",
    )
    timeout: int | None = Field(default=None, ge=1, description=_LIFETIME)
    metadata: dict[str, str] = Field(
        default_factory=dict,
        description=f"at most {MAX_METADATA_ENTRIES} entries; keys of 1 to "
        f"{MAX_METADATA_KEY_LENGTH} letters, digits and _ . : / @ + -; values of at most "
        f"{MAX_METADATA_VALUE_LENGTH} characters, no control characters; "
        f"{MAX_METADATA_BYTES} bytes in all",
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        alias="envVars",
        description=f"at most {MAX_ENV_VARS} variables; names of at most "
        f"{MAX_ENV_VAR_NAME_LENGTH} letters, digits and _ (not starting with a digit); "
        f"values of at most {MAX_ENV_VAR_VALUE_LENGTH} characters, no control characters "
        f"but tab and line breaks; {MAX_ENV_VARS_BYTES} bytes in all",
    )
    secure: bool = False
    auto_pause: bool = Field(default=False, alias="autoPause")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    volume_mounts: list[VolumeMountBody] = Field(
        default_factory=list,
        alias="volumeMounts",
        description="volumes (by name) to mount at absolute paths in the guest",
    )

    _check_metadata = field_validator("metadata")(check_metadata)
    _check_env_vars = field_validator("env_vars")(check_env_vars)


class NetworkConfig(BaseModel):
    """``network`` of a create body (e2b's ``SandboxNetworkOpts`` on the wire). Options
    that are not supported are read only so the API can refuse them by name
    (:func:`~agentenv.api.network.unsupported_options`)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")
    allow_out: _EgressList | None = Field(default=None, alias="allowOut")
    deny_out: _EgressList | None = Field(default=None, alias="denyOut")
    dns_servers: _DnsList | None = Field(default=None, alias="dnsServers")
    mask_request_host: str | None = Field(
        default=None, alias="maskRequestHost", max_length=MAX_EGRESS_ENTRY_LENGTH
    )
    egress_proxy: Any = Field(default=None, alias="egressProxy")
    https_ports: list[int] | None = Field(default=None, alias="httpsPorts")
    rules: Any = None


class NetworkUpdate(BaseModel):
    """Body of ``PUT /sandboxes/{id}/network`` (e2b's ``SandboxNetworkUpdateConfig``):
    the new egress rules, replacing all of the old ones; what is left out is cleared."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    allow_out: _EgressList | None = Field(default=None, alias="allowOut")
    deny_out: _EgressList | None = Field(default=None, alias="denyOut")
    dns_servers: _DnsList | None = Field(default=None, alias="dnsServers")
    egress_proxy: Any = Field(default=None, alias="egressProxy")
    rules: Any = None
    allow_internet_access: bool | None = None


class NetworkInfo(BaseModel):
    """``network`` of ``GET /sandboxes/{id}``: the options the sandbox has now."""

    model_config = ConfigDict(populate_by_name=True)

    allow_public_traffic: bool = Field(alias="allowPublicTraffic")
    allow_out: list[str] = Field(alias="allowOut")
    deny_out: list[str] = Field(alias="denyOut")
    dns_servers: list[str] | None = Field(default=None, alias="dnsServers")
    mask_request_host: str | None = Field(default=None, alias="maskRequestHost")
    # Header transforms, their secret placeholders unresolved (never a secret's value).
    rules: dict[str, list[dict[str, Any]]] | None = None


class AutoResume(BaseModel):
    """Whether traffic through the proxy wakes the sandbox when it is paused."""

    enabled: bool = False


class Sandbox(BaseModel):
    """A created or connected sandbox."""

    model_config = ConfigDict(populate_by_name=True)

    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(default="local", alias="clientID")
    envd_version: str = Field(alias="envdVersion")
    alias: str | None = None
    envd_access_token: str | None = Field(default=None, alias="envdAccessToken")
    traffic_access_token: str | None = Field(default=None, alias="trafficAccessToken")
    domain: str | None = None


class SandboxDetail(BaseModel):
    """``GET /sandboxes/{id}`` and the items of the list endpoints."""

    model_config = ConfigDict(populate_by_name=True)

    template_id: str = Field(alias="templateID")
    alias: str | None = None
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(default="local", alias="clientID")
    started_at: datetime = Field(alias="startedAt")
    end_at: datetime = Field(alias="endAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    state: Literal["running", "paused"]
    envd_version: str = Field(alias="envdVersion")
    metadata: dict[str, str] = Field(default_factory=dict)
    envd_access_token: str | None = Field(default=None, alias="envdAccessToken")
    domain: str | None = None
    lifecycle: Lifecycle | None = None
    pause_mode: Literal["full", "filesystem"] | None = Field(default=None, alias="pauseMode")
    # agentenv: whether a paused sandbox is committed to the repository, so that a node
    # sharing it can resume it (a pause is local first, uploaded in the background).
    pause_committed: bool | None = Field(default=None, alias="pauseCommitted")
    lineage: Lineage | None = None
    allow_internet_access: bool | None = Field(default=None, alias="allowInternetAccess")
    network: NetworkInfo | None = None
    volume_mounts: list[VolumeMountBody] | None = Field(default=None, alias="volumeMounts")


class Lineage(BaseModel):
    """Where a sandbox comes from and what came from it (agentenv's addition to E2B's
    sandbox detail)."""

    model_config = ConfigDict(populate_by_name=True)

    parent_id: str | None = Field(
        default=None, alias="parentID", description="the sandbox this one was forked from"
    )
    source_id: str = Field(
        alias="sourceID", description="the template or snapshot it was started from"
    )
    snapshot_id: str | None = Field(
        default=None,
        alias="snapshotID",
        description="the snapshot (or fork image) its disk currently builds on",
    )
    children: list[str] = Field(
        default_factory=list, description="live sandboxes forked from this one"
    )


class Lifecycle(BaseModel):
    """What happens at the timeout, and whether traffic wakes a paused sandbox."""

    model_config = ConfigDict(populate_by_name=True)

    auto_resume: bool = Field(alias="autoResume")
    on_timeout: Literal["kill", "pause"] = Field(alias="onTimeout")


class TimeoutRequest(BaseModel):
    timeout: int = Field(ge=1, description=_LIFETIME + ", from now")


class RefreshRequest(BaseModel):
    duration: int = Field(default=0, ge=0, le=MAX_REFRESH_DURATION_S)


class ConnectRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    timeout: int | None = Field(default=None, ge=1, description=_LIFETIME)


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    memory: bool = True
    require_healthy_guest: bool | None = Field(default=None, alias="requireHealthyGuest")


class NodeCacheInfo(BaseModel):
    """What this node keeps of the repository's content, against its bound."""

    model_config = ConfigDict(populate_by_name=True)

    used_bytes: int = Field(alias="usedBytes")
    limit_bytes: int = Field(alias="limitBytes")
    entries: int


class NodeDiskInfo(BaseModel):
    """The data directory's filesystem: below ``floorBytes`` free (0: no floor), creates,
    resumes, snapshots and forks answer 507 and ``status`` is ``degraded``."""

    model_config = ConfigDict(populate_by_name=True)

    free_bytes: int = Field(alias="freeBytes")
    total_bytes: int = Field(alias="totalBytes")
    floor_bytes: int = Field(alias="floorBytes")


class PublicHealth(BaseModel):
    """``GET /health`` without an API key (load balancers' and Kubernetes' probes): that
    the node answers, and nothing a stranger could learn the node's contents from."""

    status: Literal["ok", "degraded"]
    version: str


class Health(BaseModel):
    """``GET /health`` with the API key: what the node runs and holds."""

    status: Literal["ok", "degraded"]
    version: str
    vmm: str
    accel: str
    # "vmm/accel": what the node restores sandboxes under; templates, snapshots and paused
    # sandboxes saved under another mode answer 409 here.
    mode: str | None = None
    # Why this mode: what AENV_VMM/AENV_ACCEL "auto" found on the host, or "set explicitly".
    mode_reason: str | None = Field(default=None, alias="modeReason")
    templates: dict[str, str]
    sandboxes: int
    detail: str | None = None
    node: str | None = None
    repository: str | None = None
    cache: NodeCacheInfo | None = None
    # The node contract a scheduler reads (Orchestrator.node_status).
    sandboxes_by_state: dict[str, int] = Field(default_factory=dict, alias="sandboxesByState")
    allocated_vcpus: int = Field(default=0, alias="allocatedVcpus")
    allocated_memory_mib: int = Field(default=0, alias="allocatedMemoryMib")
    memory_mode: str | None = Field(default=None, alias="memoryMode")
    disk: NodeDiskInfo | None = None


class SandboxMetric(BaseModel):
    """One sample of a sandbox's resource use (E2B's ``SandboxMetric``)."""

    model_config = ConfigDict(populate_by_name=True)

    timestamp: datetime
    timestamp_unix: int = Field(alias="timestampUnix")
    cpu_count: int = Field(alias="cpuCount")
    cpu_used_pct: float = Field(alias="cpuUsedPct")
    mem_used: int = Field(alias="memUsed")
    mem_total: int = Field(alias="memTotal")
    mem_cache: int = Field(alias="memCache")
    disk_used: int = Field(alias="diskUsed")
    disk_total: int = Field(alias="diskTotal")


class SnapshotRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SNAPSHOT_NAME_LENGTH,
        # "/" separates parts of a name (team/name), so a name does not start with one.
        pattern=r"^[\w.:-][\w.:/-]*$",
    )
    memory: bool | None = None


class SnapshotInfo(BaseModel):
    """A persistent snapshot; its id or name starts sandboxes like a template."""

    model_config = ConfigDict(populate_by_name=True)

    snapshot_id: str = Field(alias="snapshotID")
    names: list[str]
    sandbox_id: str | None = Field(default=None, alias="sandboxID")
    template_id: str | None = Field(default=None, alias="templateID")
    parent_id: str | None = Field(default=None, alias="parentID")
    created_at: datetime | None = Field(default=None, alias="createdAt")


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    timeout: int | None = Field(default=None, ge=1, description=_LIFETIME)
    count: int = Field(default=1, ge=1, le=MAX_FORK_CHILDREN)


class ForkResult(BaseModel):
    """One child of a fork: the sandbox, or why it did not start."""

    sandbox: Sandbox | None = None
    error: ErrorBody | None = None


# -- templates (E2B's build API) ------------------------------------------------------------
# A template name: a reference (TEMPLATE_REF_PATTERN) without whitespace.
_TEMPLATE_NAME_PATTERN = r"^[^/\s\x00-\x1f\x7f][^\s\x00-\x1f\x7f]*$"


# A tag as a client gives it (checked and lower-cased by the orchestrator's tags module).
_Tag = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TAG_LENGTH)]
MAX_TAGS = 16


class TemplateBuildRequest(BaseModel):
    """``POST /v3/templates``."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TEMPLATE_NAME_LENGTH,
        pattern=_TEMPLATE_NAME_PATTERN,
        description="the template's name; a template's name builds it again",
    )
    alias: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TEMPLATE_NAME_LENGTH,
        pattern=_TEMPLATE_NAME_PATTERN,
        description="the name, as older SDKs send it",
    )
    tags: list[_Tag] | None = Field(
        default=None,
        max_length=MAX_TAGS,
        description="tags of the build (with the name's own, if it is name:tag); "
        "none: the default tag",
    )
    cpu_count: int | None = Field(default=None, alias="cpuCount", ge=1, le=64)
    memory_mb: int | None = Field(default=None, alias="memoryMB", ge=128, le=65536)


class TemplateRequestResponse(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    public: bool = False
    names: list[str]
    aliases: list[str]
    tags: list[str] = Field(default_factory=list)


class TemplateFileUpload(BaseModel):
    present: bool
    url: str | None = None


class BuildLogEntry(BaseModel):
    timestamp: datetime
    level: Literal["debug", "info", "warn", "error"]
    message: str
    step: str | None = None


class BuildStatusReason(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    message: str
    step: str | None = None
    log_entries: list[BuildLogEntry] | None = Field(default=None, alias="logEntries")


class TemplateBuildInfo(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    status: Literal["waiting", "building", "ready", "error"]
    logs: list[str] = Field(default_factory=list)
    log_entries: list[BuildLogEntry] = Field(default_factory=list, alias="logEntries")
    reason: BuildStatusReason | None = None


class TemplateBuildSummary(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    build_id: str = Field(alias="buildID")
    status: Literal["waiting", "building", "ready", "error"]
    created_at: datetime = Field(alias="createdAt")
    updated_at: datetime = Field(alias="updatedAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int | None = Field(default=None, alias="diskSizeMB")
    envd_version: str | None = Field(default=None, alias="envdVersion")


class TemplateInfo(BaseModel):
    """An item of ``GET /v2/templates`` (E2B's ``Template``: ``createdBy`` and
    ``lastSpawnedAt`` are required, null here)."""

    model_config = ConfigDict(populate_by_name=True)

    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    public: bool = False
    aliases: list[str]
    names: list[str]
    created_at: datetime = Field(alias="createdAt")
    updated_at: datetime = Field(alias="updatedAt")
    created_by: None = Field(default=None, alias="createdBy")
    last_spawned_at: datetime | None = Field(default=None, alias="lastSpawnedAt")
    spawn_count: int = Field(default=0, alias="spawnCount")
    build_count: int = Field(default=1, alias="buildCount")
    envd_version: str = Field(alias="envdVersion")
    build_status: Literal["waiting", "building", "ready", "error"] = Field(alias="buildStatus")


class TemplateWithBuilds(TemplateInfo):
    """``GET /templates/{id}``: the template with its builds, newest first."""

    builds: list[TemplateBuildSummary]


class AssignTemplateTagsRequest(BaseModel):
    """``POST /templates/tags``: point ``tags`` at the build ``target`` names."""

    target: str = Field(
        min_length=1,
        max_length=MAX_TEMPLATE_REF_LENGTH,
        pattern=TEMPLATE_REF_PATTERN,
        description="the build to tag: name:tag, or name (its default tag)",
    )
    tags: list[_Tag] = Field(min_length=1, max_length=MAX_TAGS)


class AssignedTemplateTags(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    tags: list[str]
    build_id: str = Field(alias="buildID")


class DeleteTemplateTagsRequest(BaseModel):
    """``DELETE /templates/tags``: remove ``tags`` (not ``default``) from template ``name``."""

    name: str = Field(
        min_length=1, max_length=MAX_TEMPLATE_REF_LENGTH, pattern=TEMPLATE_REF_PATTERN
    )
    tags: list[_Tag] = Field(min_length=1, max_length=MAX_TAGS)


class TemplateTag(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    tag: str
    build_id: str = Field(alias="buildID")
    created_at: datetime = Field(alias="createdAt", description="when the tag was assigned")


class TemplateAliasResponse(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    template_id: str = Field(alias="templateID")
    public: bool = False


# -- secrets -------------------------------------------------------------------------------
class NewSecret(BaseModel):
    """Body of ``POST /secrets`` (e2b's ``NewSecret``). The value is write-only."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    value: str = Field(repr=False)
    metadata: dict[str, str] | None = None


class SecretUpdate(BaseModel):
    """Body of ``POST /secrets/{secret}``: a new value (the next version), and metadata
    that replaces the old when given."""

    model_config = ConfigDict(extra="forbid")

    value: str = Field(repr=False)
    metadata: dict[str, str] | None = None


class SecretInfo(BaseModel):
    """A secret as every route shows it: never its value."""

    model_config = ConfigDict(populate_by_name=True)

    secret_id: str = Field(alias="secretID")
    name: str
    current_version: int = Field(alias="currentVersion")
    metadata: dict[str, str]
    created_at: datetime = Field(alias="createdAt")
    updated_at: datetime = Field(alias="updatedAt")
