"""The node server's configuration: one frozen, validated :class:`Config`, and the only
place the server reads its environment (code elsewhere gets its values from ``Config``).

Precedence: explicit keyword arguments > environment variables > config file > defaults.
The config file is ``$AENV_CONFIG`` if set, else ``$AENV_HOME/config.toml`` if it exists;
its keys are the field names (flat, or in an ``[agentenv]`` table), the S3 settings in an
``[s3]`` table. A field ``name`` is read from ``AENV_<NAME>``, except ``s3`` (the usual
``AWS_*`` variables, see :class:`~agentenv.snapshots.settings.S3Settings`) and
``user_home`` (``HOME``). Pydantic coerces the values (``"4"`` for a number,
``1/true/yes/on`` and ``0/false/no/off`` for a flag) and validates them; a bad value is a
:class:`ConfigError` naming the key, where it came from, what was expected and what it
got.

Unknown keys are refused with the list of valid ones: in the file, as keyword arguments,
and as ``AENV_*`` variables, except those in :data:`NOT_SETTINGS`, which the client, the
test suite and the install scripts use under the same prefix. A misspelt setting thus
stops the server instead of being silently ignored.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import secrets
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentenv.limits import MAX_FORK_CHILDREN
from agentenv.snapshots.settings import S3Settings

DEFAULT_HOME = Path("/var/lib/agentenv")
DEFAULT_IMAGE_CACHE = Path("/var/cache/agentenv/images")

VmmSetting = Literal["auto", "qemu", "firecracker"]
AccelSetting = Literal["auto", "kvm", "tcg"]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

#: ``AENV_*`` variables that are not server settings, so the server does not refuse them
#: when they are in its environment (a shell that also runs the CLI, the test runner).
NOT_SETTINGS = frozenset(
    {
        "AENV_CONFIG",  # names the config file; read by Config.load itself
        "AENV_SERVER",  # the aenv CLI's and agentenv.client's server URL
        "AENV_TEST_DIR",  # tests and benchmarks: where their servers keep data
        "AENV_KEEP_TEST_ROOT",  # tests: keep that data for a post-mortem
        "AENV_CACHE",  # scripts/install: cache root
        "AENV_PYTHON",  # scripts/install: the Python the virtualenv is made with
        "AENV_SKIP_DATA_FS",  # scripts/install: leave AENV_HOME's filesystem alone
        "AENV_KVM_TESTS",  # tests: run the nested KVM tests (tests/kvm; scripts/test sets it)
        "AENV_KVM_HOST_DIR",  # scripts/kvm-host: the test host's state directory
    }
)

# Values never repeated in an error message.
_SECRET_KEYS = frozenset(
    {"api_key", "s3.secret_access_key", "s3.session_token", "envd_token_key", "secrets_key"}
)


class ConfigError(ValueError):
    """A configuration value is missing, unknown or malformed."""


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional K/M/G/T suffix (powers of 1024;
    ``KiB``, ``MB`` and ``B`` spellings accepted)."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = value[-1:] if value[-1:] in _SIZE_UNITS else ""
    number = value[: len(value) - len(unit)].strip()
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except ValueError:
        raise ConfigError(f"not a size: {text!r} (use e.g. 512M, 20G)") from None
    if size <= 0:
        raise ConfigError(f"size must be positive, got {text!r}")
    return size


def free_space_floor_bytes(text: str, filesystem_bytes: int) -> int:
    """Bytes ``text`` (a size, or ``N%`` of a filesystem of ``filesystem_bytes``) stands for."""
    if text.strip().endswith("%"):
        try:
            percent = float(text.strip()[:-1])
        except ValueError:
            raise ConfigError(f"not a percentage: {text!r}") from None
        if not 0 < percent < 100:
            raise ConfigError(f"percentage must be between 0 and 100, got {text!r}")
        return int(filesystem_bytes * percent / 100)
    return parse_size(text)


class Config(BaseModel):
    """A node server's settings. Build it with :meth:`load` (or derive one with
    :meth:`with_overrides`), which turn invalid input into :class:`ConfigError`;
    constructing it directly raises Pydantic's ``ValidationError`` instead."""

    # Numbers are accepted where text is expected (``node_id = 7``, ``cache_size =
    # 1073741824`` in the file).
    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True)

    home: Path = DEFAULT_HOME
    listen: str = "127.0.0.1:8000"
    # Left out of repr() so a logged configuration does not show it.
    api_key: str | None = Field(default=None, repr=False)
    image_cache: Path = DEFAULT_IMAGE_CACHE
    vmm: VmmSetting = "auto"
    accel: AccelSetting = "auto"
    vcpus: int = Field(default=2, ge=1)
    memory_mib: int = Field(default=512, ge=128)
    default_timeout: int = Field(default=300, gt=0)
    max_timeout: int = Field(default=24 * 3600, gt=0)
    net_subnet: str | None = None
    domain: str | None = None
    # PEM files of a certificate (with its chain) and its key: with both set the server
    # speaks only HTTPS, so a wildcard certificate for `domain` and `*.domain` lets the
    # SDK use E2B_DOMAIN alone (https://api.{domain}, https://{port}-{id}.{domain}).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    log_level: str = "info"
    # Seconds a paused sandbox keeps its network namespace before it is released, so a
    # quick pause/resume cycle does not pay for tearing it down and building it again.
    network_linger: float = 30.0
    # How a new sandbox's RAM is backed: "file" (a reflink of the template's RAM file,
    # mapped shared: pause saves device state only, snapshots reflink it), "shared-image"
    # (a private copy-on-write mapping of the template's file: denser, pause streams RAM),
    # or "auto" ("file", with a sparse copy where the data directory cannot reflink:
    # "shared-image" is only chosen when asked for, see SECURITY.md, Known limits).
    sandbox_memory: Literal["auto", "file", "shared-image"] = "auto"
    # How long a template boot may take before we give up (TCG cold boots take seconds).
    template_boot_timeout: float = 120.0
    template_boot_attempts: int = Field(default=3, ge=1)
    # The durable snapshot repository: file:///path (a directory, shared between nodes
    # over a shared filesystem) or s3://bucket/prefix (reached with `s3`). Default: a
    # directory under home.
    repository: str | None = None
    # Endpoint, credentials and region of an s3:// repository.
    s3: S3Settings = Field(default_factory=S3Settings)
    # Seconds between automatic garbage collections of the repository (blobs and chunks
    # no record needs), on whichever node comes first; 0 turns them off (then
    # `aenv-server --collect-garbage` does it by hand). Safe while nodes commit.
    repository_gc_interval: float = Field(default=6 * 3600.0, ge=0)
    # What a collection keeps regardless: objects written less than this many seconds
    # ago. It must exceed the longest gap between a commit's push and its record.
    repository_gc_grace: float = Field(default=3600.0, ge=0)
    # Bytes this node may keep of what it fetched from the repository (K/M/G suffixes).
    cache_size: str = "20G"
    # This node's name in the repository (who holds a paused sandbox). Default: derived
    # from the host name and data directory.
    node_id: str | None = None
    # The cluster scheduler this node sends heartbeats to (http://host:9090, see
    # agentenv.cluster), or its replicas comma-separated (each heartbeat goes to the first
    # that answers); None: a node on its own, no heartbeats.
    scheduler_url: str | None = None
    # The CA bundle (PEM) this node verifies an https:// scheduler with; None: the
    # system's trusted certificates.
    ca_file: Path | None = None
    # The URL gateways reach this node at, reported in heartbeats; None: http://{listen}.
    node_url: str | None = None
    # Seconds between heartbeats; the scheduler marks a node down after several missed.
    heartbeat_interval: float = Field(default=2.0, gt=0)
    # The cluster this node belongs to, as GET /nodes names it (E2B's clusterID).
    cluster_id: str = Field(default="default", min_length=1, max_length=200)
    # Seconds a connect of a sandbox another node paused waits for that pause's commit
    # to reach the repository before answering 503. Below the SDK's 60 s request
    # timeout, so the client reads why rather than timing out.
    commit_wait: float = Field(default=50.0, ge=0)
    # Seconds envd's /init may take after a restore (create, resume, fork) before the
    # sandbox is given up: generous, as guests starved of CPU (many forks at once on a
    # loaded TCG host, or nested KVM) answer late.
    envd_init_timeout: float = Field(default=30.0, gt=0)
    # Sandboxes that may be starting at once (restore until envd's /init is done): more
    # wait, and are refused (503) after 50 s. None: 4 per CPU, and never fewer than the
    # largest fork's children (each counts one). 0: no bound (resources.StartGate).
    max_starting: int | None = Field(default=None, ge=0)

    @property
    def start_places(self) -> int:
        """``max_starting``, with its default worked out for this host."""
        if self.max_starting is not None:
            return self.max_starting
        return max(MAX_FORK_CHILDREN, 4 * (os.cpu_count() or 1))

    # Registries reached over plain HTTP / without TLS verification, comma-separated
    # (localhost ones always are).
    insecure_registries: str = ""
    # E2B's v1 create (POST /sandboxes) secures a sandbox only when the body says
    # "secure": true. Here every sandbox is secured unless this is set, which brings back
    # E2B's v1 behaviour for clients that cannot handle an access token.
    honour_v1_secure_flag: bool = False
    # The Firecracker binary; None: the one scripts/install-firecracker caches, else
    # `firecracker` on PATH (see agentenv.vmm.firecracker_binary).
    firecracker: Path | None = None
    # The server user's home directory ($HOME), where skopeo (which the server runs to
    # pull images) looks for a user signature policy.
    user_home: Path = Path("/root")
    # The key sandboxes' envd tokens are derived from (hex, at least 32 digits), so they
    # are never stored (orchestrator/tokens.py). Nodes sharing a repository must have the
    # same one. Default: envd_token.key in the data directory, made at first start.
    envd_token_key: str | None = Field(default=None, repr=False, pattern=r"^[0-9a-fA-F]{32,}$")
    # The AES-256-GCM key secrets (the E2B secrets API) are encrypted with in the
    # repository (hex, 64 digits); it is never written there. Nodes sharing a repository
    # must have the same one. Default: secrets.key in the data directory, made at first
    # start (mode 0600).
    secrets_key: str | None = Field(default=None, repr=False, pattern=r"^[0-9a-fA-F]{64}$")
    # Free space the data directory's filesystem must keep: creates, forks and snapshots
    # are refused (507) below it. A size (512M, 20G) or a percentage of the filesystem
    # (5%); None: no floor.
    free_space_floor: str | None = None
    # Run every VMM confined: its own uid, cgroup and mount namespace, no capabilities,
    # QEMU's seccomp filter (see agentenv.vmm.confine); Firecracker VMMs under
    # Firecracker's jailer, chrooted (agentenv.vmm.firecracker_jail). Turn off only for
    # development on a host that lacks what confinement needs; the server refuses to
    # start otherwise.
    confine_vmm: bool = True
    # Base of the ids VMMs run as, far above those of real users: the group that opens
    # root-only devices (/dev/kvm, /dev/net/tun), then a block of 65536 uids per server
    # (chosen by its instance tag).
    vmm_id_base: int = Field(default=1_000_000_000, ge=100_000, le=3_000_000_000)
    # Memory a confined VMM may use beyond its guest's RAM (QEMU itself, its TCG
    # translation cache, device buffers), in MiB; its cgroup's memory limit.
    vmm_memory_overhead_mib: int = Field(default=256, ge=32)
    # Whether guests whose RAM is a file of their own give freed pages back to the host
    # (virtio-balloon free page reporting). Their fork children then get RAM files of
    # their own too (a clone of the fork image) instead of sharing its page cache: a
    # sandbox that freed 200 MiB went from 369 to 132 MiB PSS, a fork child from 83 to
    # 104 (bench/memory.py), and 16 children starting at once on a loaded 2-core TCG host
    # missed envd's 30 s /init deadline. Off by default for that; applies to templates
    # built while it is on (see docs/architecture.md, "Guest memory").
    free_page_reporting: bool = False
    # QEMU's TCG translation cache, in MiB (``-accel tcg,tb-size=N``; ignored under KVM).
    # Translated code stays resident, so this caps what a sandbox that ran code keeps
    # while idle; too small and the guest's code is retranslated over and over
    # (bench/tcg_cache.py: 8 and 16 MiB made `python3 -c 'import json'` 2-5x slower,
    # 48 MiB was as fast as the 64 MiB used before and kept 25 MiB less after work).
    tcg_tb_size_mib: int = Field(default=48, ge=1, le=2048)
    # Leave QEMU's MADV_HUGEPAGE on guest RAM. With it, every first touch of a page of a
    # RAM file reads 2 MiB around it into the page cache: 138 MiB cached for 21 MiB a
    # sandbox used, which filled this 24 GiB host at about 110 idle sandboxes. Without it
    # (the default) the RAM advice library makes it MADV_RANDOM and the node reads ahead
    # what restored guests touch first (agentenv/vmm/working_set.py). A KVM host that
    # wants large folios behind guest RAM, and has memory to spare, may turn it on.
    guest_ram_huge_pages: bool = False
    # Threads a confined VMM may have (its cgroup's pids limit).
    vmm_pids_max: int = Field(default=512, ge=16)
    # Remount the host's cgroup2 hierarchy with favordynmods at start-up: moving each VMM
    # into its cgroup then no longer waits for an RCU grace period (10-20 ms per VMM
    # start), at a small cost to every fork on the host. False leaves the mount alone.
    cgroup_favordynmods: bool = True
    # Seconds between samples of every running sandbox's metrics (E2B's interval is 5 s);
    # envd is asked once a minute, the host measures in between (orchestrator/metrics.py).
    # 0: no history, a sandbox is sampled when its metrics are asked for.
    metrics_interval: float = Field(default=5.0, ge=0)
    # Guest RAM this node lends its running sandboxes, as a multiple of its own RAM: a
    # create, fork or resume that would go beyond it is refused (503) instead of pushing
    # the node into swap or the OOM killer. Idle sandboxes use a fraction of their RAM
    # (bench/density.py). 0: no limit.
    memory_overcommit: float = Field(default=4.0, ge=0)
    # MiB of memory the host keeps beyond what its VMMs use: a create, fork or resume is
    # refused (503) while less is left (MemAvailable less the mapped file pages, which
    # are guest RAM). The overcommit ratio assumes what idle sandboxes use; this holds
    # when they use more. 0: no check.
    memory_reserve_mib: int = Field(default=1024, ge=0)
    # Percent of the last 10 s in which the host stalled on memory (its pressure stall
    # information, ``some avg10``) at which a create, fork or resume is refused (503):
    # the host is already reclaiming what its guests use. 0: no check.
    memory_pressure_limit: float = Field(default=10.0, ge=0, le=100)
    # How much of a VM's console output is kept (the most recent), K/M/G suffixes.
    console_log_size: str = "1M"

    # -- validation ----------------------------------------------------------------------
    @field_validator("listen")
    @classmethod
    def _check_listen(cls, listen: str) -> str:
        host, sep, port = listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("expected host:port with a port in 1-65535")
        return listen

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, level: str) -> str:
        if level.lower() not in LOG_LEVELS:
            raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
        return level.lower()

    @field_validator("cache_size")
    @classmethod
    def _check_cache_size(cls, text: str) -> str:
        try:
            parse_size(text)
        except ConfigError:
            raise ValueError("expected a positive size such as 512M or 20G") from None
        return text

    @field_validator("free_space_floor")
    @classmethod
    def _check_free_space_floor(cls, text: str | None) -> str | None:
        if text is not None:
            try:
                free_space_floor_bytes(text, 1)
            except ConfigError:
                raise ValueError(
                    "expected a size such as 512M or 20G, or a percentage such as 5%"
                ) from None
        return text

    @field_validator("console_log_size")
    @classmethod
    def _check_console_log_size(cls, text: str) -> str:
        try:
            size = parse_size(text)
        except ConfigError:
            raise ValueError("expected a positive size such as 512K or 1M") from None
        if size < 16 * 1024:
            raise ValueError("expected at least 16K")
        return text

    @field_validator("repository")
    @classmethod
    def _check_repository(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("file:///", "s3://")):
            raise ValueError("expected file:///path or s3://bucket/prefix")
        return url

    @model_validator(mode="after")
    def _check_timeouts(self) -> Config:
        if self.default_timeout > self.max_timeout:
            raise ValueError(
                f"default_timeout ({self.default_timeout}) must be at most "
                f"max_timeout ({self.max_timeout})"
            )
        return self

    @model_validator(mode="after")
    def _check_tls(self) -> Config:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        return self

    # -- derived paths -------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    @property
    def scheme(self) -> str:
        """``https`` when the server has a certificate, else ``http``."""
        return "https" if self.tls_cert is not None else "http"

    @property
    def url(self) -> str:
        """Where this server is reached on its listening address."""
        return f"{self.scheme}://{self.listen}"

    @property
    def db_path(self) -> Path:
        return self.home / "state.db"

    @property
    def api_key_path(self) -> Path:
        return self.home / "api_key"

    @property
    def templates_dir(self) -> Path:
        return self.home / "templates"

    @property
    def snapshots_dir(self) -> Path:
        return self.home / "snapshots"

    @property
    def sandboxes_dir(self) -> Path:
        return self.home / "sandboxes"

    @property
    def working_sets_dir(self) -> Path:
        """What restored guests touched first, per snapshot RAM file (vmm/working_set.py)."""
        return self.home / "working-sets"

    @property
    def instance_tag(self) -> str:
        """Short, stable tag naming this server's host resources (netns, links), so several
        servers with different data directories can share one host."""
        return hashlib.sha256(str(self.home.resolve()).encode()).hexdigest()[:4]

    @property
    def subnet_path(self) -> Path:
        """Where a server records the veth address range it chose at its first start."""
        return self.home / "subnet"

    @property
    def repository_url(self) -> str:
        return self.repository or (self.home / "repository").resolve().as_uri()

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"

    @property
    def oci_cache(self) -> Path:
        return self.home / "oci"

    @property
    def cache_bytes(self) -> int:
        return parse_size(self.cache_size)

    @property
    def envd_token_key_path(self) -> Path:
        return self.home / "envd_token.key"

    @property
    def secrets_key_path(self) -> Path:
        return self.home / "secrets.key"

    def free_space_floor_of(self, filesystem_bytes: int) -> int:
        """Bytes the data directory's filesystem (of ``filesystem_bytes``) must keep free."""
        if self.free_space_floor is None:
            return 0
        return free_space_floor_bytes(self.free_space_floor, filesystem_bytes)

    @property
    def console_log_bytes(self) -> int:
        return parse_size(self.console_log_size)

    @property
    def node_name(self) -> str:
        if self.node_id:
            return self.node_id
        return f"{socket.gethostname()}-{self.instance_tag}"

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """The configuration from ``env`` (default: the process environment), the config
        file it names and ``overrides`` (``None`` values are ignored, so unset command-line
        options can be passed as they are)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        home = Path(overrides.get("home") or env.get("AENV_HOME") or DEFAULT_HOME)
        config_file = env.get("AENV_CONFIG")
        path = Path(config_file) if config_file else home / "config.toml"
        if path.exists():
            for key, value in _read_file(path).items():
                values[key] = value
                sources[key] = f"in {path}"
                if key == "s3" and isinstance(value, dict):
                    sources.update({f"s3.{name}": f"in {path}" for name in value})
        elif config_file:
            raise ConfigError(f"config file {path} does not exist")

        _refuse_unknown_variables(env)
        for variable, name in _ENVIRONMENT.items():
            if env.get(variable):
                values[name] = env[variable].strip()
                sources[name] = f"from {variable}"
        s3_from_env = S3Settings.environment_values(env)
        if s3_from_env:
            from_file = values.get("s3")
            s3_values = dict(from_file) if isinstance(from_file, dict) else {}
            for name, (variable, value) in s3_from_env.items():
                s3_values[name] = value.strip()
                sources[f"s3.{name}"] = f"from {variable}"
            values["s3"] = s3_values

        for key, value in overrides.items():
            if value is not None:
                values[key] = value
                sources[key] = "as an argument"
        return cls._validated(values, sources)

    @classmethod
    def _validated(cls, values: Mapping[str, Any], sources: Mapping[str, str]) -> Config:
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise _config_error(exc, sources) from None

    def with_overrides(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied, validated like :meth:`load`'s input."""
        return self._validated({**dict(self), **changes}, dict.fromkeys(changes, "as an argument"))

    def ensure_api_key(self) -> str:
        """The configured key, else the one stored under the data directory, generated
        (mode 0600) on first start. Keys look like E2B's (``e2b_<hex>``) because some SDK
        releases validate that shape."""
        if self.api_key:
            return self.api_key
        if self.api_key_path.exists():
            return self.api_key_path.read_text().strip()
        self.home.mkdir(parents=True, exist_ok=True)
        key = "e2b_" + secrets.token_hex(20)
        fd = os.open(self.api_key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return key


# Environment variable -> Config field: AENV_<NAME> for each field but the two that have
# conventional variables of their own.
_ENVIRONMENT: dict[str, str] = {
    **{f"AENV_{name.upper()}": name for name in Config.model_fields if name != "user_home"},
    "HOME": "user_home",
}
del _ENVIRONMENT["AENV_S3"]


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    # Accept both a flat file and one with an [agentenv] table.
    if "agentenv" not in data:
        return data
    section = data["agentenv"]
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: [agentenv] must be a table")
    outside = sorted(key for key in data if key != "agentenv")
    if outside:
        raise ConfigError(
            f"{path}: {', '.join(outside)} outside the [agentenv] table; move them into it"
        )
    return dict(section)


def _refuse_unknown_variables(env: Mapping[str, str]) -> None:
    unknown = sorted(
        variable
        for variable, value in env.items()
        if variable.startswith("AENV_")
        and value
        and variable not in _ENVIRONMENT
        and variable not in NOT_SETTINGS
    )
    if not unknown:
        return
    settings = sorted(variable for variable in _ENVIRONMENT if variable.startswith("AENV_"))
    problems = [
        f"unknown setting {variable} in the environment{_did_you_mean(variable, settings)}"
        for variable in unknown
    ]
    raise ConfigError(
        "; ".join(problems)
        + f". Valid settings: {', '.join(settings)} (S3: the AWS_* variables). "
        + f"Allowed but not settings: {', '.join(sorted(NOT_SETTINGS))}"
    )


def _did_you_mean(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _config_error(exc: ValidationError, sources: Mapping[str, str]) -> ConfigError:
    """One message for all of ``exc``'s errors, each naming the key, where its value
    came from, what was expected and what was given."""
    problems = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        key = ".".join(loc)
        if not key:  # a check across fields; its message names them
            problems.append(str(error["ctx"]["error"]) if "ctx" in error else error["msg"])
            continue
        source = sources.get(key) or sources.get(loc[0]) or ""
        if error["type"] == "extra_forbidden":
            if loc[0] == "s3" and len(loc) > 1:
                valid = [f"s3.{name}" for name in S3Settings.model_fields]
            else:
                valid = list(Config.model_fields)
            problems.append(
                " ".join(filter(None, ["unknown key", key, source]))
                + f"{_did_you_mean(key, valid)}; valid keys: {', '.join(sorted(valid))}"
            )
            continue
        if error["type"] == "value_error":
            expected = str(error["ctx"]["error"])
        else:
            expected = error["msg"][:1].lower() + error["msg"][1:]
        given = "(hidden)" if key in _SECRET_KEYS else repr(error["input"])
        where = f" ({source})" if source else ""
        problems.append(f"{key}{where}: {expected}; got {given}")
    return ConfigError("; ".join(problems))
