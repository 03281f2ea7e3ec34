"""One :class:`Config` for a node server, read from a TOML file and ``AENV_*`` variables.

Precedence: explicit keyword arguments > environment variables > config file > defaults.
The config file is ``$AENV_CONFIG`` if set, else ``$AENV_HOME/config.toml`` if it exists.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

DEFAULT_HOME = Path("/var/lib/agentenv")
DEFAULT_IMAGE_CACHE = Path("/var/cache/agentenv/images")

VmmSetting = Literal["auto", "qemu", "firecracker"]
AccelSetting = Literal["auto", "kvm", "tcg"]


class ConfigError(ValueError):
    """A configuration value is missing or malformed."""


# Environment variable -> Config field. Everything settable in the file is settable here.
_ENV_FIELDS: dict[str, str] = {
    "AENV_HOME": "home",
    "AENV_LISTEN": "listen",
    "AENV_API_KEY": "api_key",
    "AENV_IMAGE_CACHE": "image_cache",
    "AENV_VMM": "vmm",
    "AENV_ACCEL": "accel",
    "AENV_VCPUS": "vcpus",
    "AENV_MEMORY_MIB": "memory_mib",
    "AENV_DEFAULT_TIMEOUT": "default_timeout",
    "AENV_MAX_TIMEOUT": "max_timeout",
    "AENV_NET_SUBNET": "net_subnet",
    "AENV_DOMAIN": "domain",
    "AENV_LOG_LEVEL": "log_level",
    "AENV_NETWORK_LINGER": "network_linger",
    "AENV_SANDBOX_MEMORY": "sandbox_memory",
    "AENV_REPOSITORY": "repository",
    "AENV_CACHE_SIZE": "cache_size",
    "AENV_NODE_ID": "node_id",
    "AENV_INSECURE_REGISTRIES": "insecure_registries",
    "AENV_HONOUR_V1_SECURE_FLAG": "honour_v1_secure_flag",
}

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


@dataclass(frozen=True)
class Config:
    home: Path = DEFAULT_HOME
    listen: str = "127.0.0.1:8000"
    api_key: str | None = None
    image_cache: Path = DEFAULT_IMAGE_CACHE
    vmm: VmmSetting = "auto"
    accel: AccelSetting = "auto"
    vcpus: int = 2
    memory_mib: int = 512
    default_timeout: int = 300
    max_timeout: int = 24 * 3600
    net_subnet: str | None = None
    domain: str | None = None
    log_level: str = "info"
    # Seconds a paused sandbox keeps its network namespace before it is released, so a
    # quick pause/resume cycle does not pay for tearing it down and building it again.
    network_linger: float = 30.0
    # How a new sandbox's RAM is backed: "file" (a reflink of the template's RAM file,
    # mapped shared: pause saves device state only, snapshots reflink it), "shared-image"
    # (a private copy-on-write mapping of the template's file: denser, pause streams RAM),
    # or "auto" ("file" where the data directory can reflink).
    sandbox_memory: Literal["auto", "file", "shared-image"] = "auto"
    # How long a template boot may take before we give up (TCG cold boots take seconds).
    template_boot_timeout: float = 120.0
    template_boot_attempts: int = 3
    # The durable snapshot repository: file:///path (a directory, shared between nodes
    # over a shared filesystem) or s3://bucket/prefix (endpoint and credentials from the
    # usual AWS_* variables). Default: a directory under home.
    repository: str | None = None
    # Bytes this node may keep of what it fetched from the repository (K/M/G suffixes).
    cache_size: str = "20G"
    # This node's name in the repository (who holds a paused sandbox). Default: derived
    # from the host name and data directory.
    node_id: str | None = None
    # Registries reached over plain HTTP / without TLS verification, comma-separated
    # (localhost ones always are).
    insecure_registries: str = ""
    # E2B's v1 create (POST /sandboxes) secures a sandbox only when the body says
    # "secure": true. Here every sandbox is secured unless this is set, which brings back
    # E2B's v1 behaviour for clients that cannot handle an access token.
    honour_v1_secure_flag: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    # -- derived paths -------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

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
    def node_name(self) -> str:
        if self.node_id:
            return self.node_id
        return f"{socket.gethostname()}-{self.instance_tag}"

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def load(cls, env: dict[str, str] | None = None, **overrides: Any) -> Config:
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {}
        home = Path(overrides.get("home") or env.get("AENV_HOME") or DEFAULT_HOME)
        config_file = env.get("AENV_CONFIG")
        path = Path(config_file) if config_file else home / "config.toml"
        if path.exists():
            values.update(_read_file(path))
        elif config_file:
            raise ConfigError(f"config file {path} does not exist")
        for var, name in _ENV_FIELDS.items():
            if env.get(var):
                values[name] = env[var]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls._from_mapping(values)

    @classmethod
    def _from_mapping(cls, values: dict[str, Any]) -> Config:
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                extra[key] = value
                continue
            kwargs[key] = _coerce(key, value, known[key].type)
        config = cls(**kwargs, extra=extra)
        config.validate()
        return config

    def validate(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"listen must be host:port, got {self.listen!r}")
        if self.vmm not in ("auto", "qemu", "firecracker"):
            raise ConfigError(f"vmm must be auto, qemu or firecracker, got {self.vmm!r}")
        if self.accel not in ("auto", "kvm", "tcg"):
            raise ConfigError(f"accel must be auto, kvm or tcg, got {self.accel!r}")
        if self.sandbox_memory not in ("auto", "file", "shared-image"):
            raise ConfigError(
                f"sandbox_memory must be auto, file or shared-image, got {self.sandbox_memory!r}"
            )
        if self.vcpus < 1 or self.memory_mib < 128:
            raise ConfigError("vcpus must be >= 1 and memory_mib >= 128")
        if not 0 < self.default_timeout <= self.max_timeout:
            raise ConfigError("default_timeout must be positive and at most max_timeout")
        parse_size(self.cache_size)
        if self.repository is not None and not self.repository.startswith(("file:///", "s3://")):
            raise ConfigError(
                f"repository must be file:///path or s3://bucket/prefix, got {self.repository!r}"
            )

    def with_overrides(self, **changes: Any) -> Config:
        return replace(self, **changes)

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


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    # Accept both a flat file and one with an [agentenv] table.
    section = data.get("agentenv", data)
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: [agentenv] must be a table")
    return dict(section)


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    text = str(annotation)
    if text == "bool" and not isinstance(value, bool):
        word = str(value).strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    try:
        if "Path" in text:
            return Path(value)
        if text == "int":
            return int(value)
        if text == "float":
            return float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: expected {text}, got {value!r}") from exc
    return value
